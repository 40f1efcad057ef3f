#!/usr/bin/env bash
# The vllm rollout backend on one H200 (issue 10). Prepare here: bash ../shared/device/fetch-vllm.sh and
# bash ../shared/device/fetch-wheels.sh. Then, in ONE batch of `run` calls (the machine stays warm):
#   1. carry .vllm/p0:  rm -rf /tmp/vb; mkdir -p /tmp/vb && cp .vllm/p0/* /tmp/vb/
#   2. carry .vllm/p1:  cp .vllm/p1/* /tmp/vb/
#   3. carry .whl:      mkdir -p /tmp/whl && cp .whl/* /tmp/whl/
#   4. carry .vllm/p2:  bash .vllm/p2/install.sh && bash tests/gpu/run_vllm_on_gpu_machine.sh engine
#   5. (nothing):       BACKEND=vllm STEPS=3 bash tests/gpu/run_trainer_on_gpu_machine.sh
# "engine" (= "tests" + "bench") runs the GPU tests of the engine (grids, pixels, weight sync, sleep), of the
# weight channel's GPU transports with `flexrl bench channel` (CUDA IPC on one GPU; NCCL and a
# tensor-parallel engine need two: "channel") and `flexrl bench rollout` on the 7B shape (vLLM vs HF
# generate, colocated sync); results under $OUT.
set -euo pipefail
out=${OUT:-/tmp/flexrl-gpu}
mkdir -p "$out"
source tests/gpu/gpu_env.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)
status=0
if [ "${1:-engine}" = engine ] || [ "${1:-}" = tests ]; then
  python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_vllm_engine_gpu.py 2>&1 | grep -v "Loading weights" \
    | grep -v "^INFO\|^WARNING\|^(EngineCore" | tee "$out/vllm_engine_tests.txt" | tail -30 || status=1
  # an engine of a run at temperature 0.7 (processed log-probs): in a pytest process of its own
  python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_vllm_temperature_gpu.py 2>&1 | grep -v "Loading weights" \
    | grep -v "^INFO\|^WARNING\|^(EngineCore" | tee -a "$out/vllm_engine_tests.txt" | tail -8 || status=1
  # Qwen3-VL dense and MoE (issue 38): timestamped videos, weight sync through a level-2 sleep; one engine a process
  for family in dense moe; do
    python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_vllm_qwen3_gpu.py -k "$family" 2>&1 \
      | grep -v "Loading weights" | grep -v "^INFO\|^WARNING\|^(EngineCore" | tee -a "$out/vllm_engine_tests.txt" \
      | tail -8 || status=1
  done
  echo "engine tests done after $(( $(date +%s) - start )) s"
fi
if [ "${1:-engine}" = engine ] || [ "${1:-}" = tests ] || [ "${1:-}" = channel ]; then
  # the weight channel's GPU transports: shared in place on one GPU; NCCL between GPUs (two GPUs)
  python3 -m pytest -q -s -p no:cacheprovider -rs tests/gpu/test_weight_channel_gpu.py 2>&1 | tail -5 \
    | tee "$out/weight_channel_tests.txt" || status=1
  for receivers in 1 2; do  # two receivers: two openers of every shared bucket
    python3 -m flexrl_ds bench channel --receivers $receivers --json "$out/channel_bench_$receivers.json" 2>&1 \
      | grep "^\[bench\|Error\|error" | tail -8 | tee -a "$out/channel_bench.txt" || status=1
  done
  # a tensor-parallel separate engine (two GPUs): both shards' workers receive over the channel
  python3 -m pytest -q -s -p no:cacheprovider -rs tests/gpu/test_vllm_tp_gpu.py 2>&1 | grep -v "Loading weights" \
    | grep -v "^INFO\|^WARNING\|^(EngineCore\|^(Worker" | tail -8 | tee -a "$out/weight_channel_tests.txt" || status=1
fi
if [ "${1:-engine}" = engine ] || [ "${1:-}" = bench ]; then
  # ROLLOUT_BENCH_ARGS: more options of `flexrl bench rollout` (e.g. "--hf-kv-caches dynamic --repeats 2")
  python3 -m flexrl_ds bench rollout --shape 7b ${ROLLOUT_BENCH_ARGS:-} --json "$out/rollout_7b.json" \
    --plot "$out/rollout_7b.png" 2>&1 | grep "^\[bench\|Error\|error" \
    | tail -20 | tee "$out/rollout_7b.txt" || status=1
fi
echo "total $(( $(date +%s) - start )) s"
exit $status
