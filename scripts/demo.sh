#!/usr/bin/env bash
# The main job on a fresh CPU machine: install, then run the most complete pipeline that exists
# today (the GRPO loop itself is not built yet): plan a GRPO step with FlexUlysses, compare it with
# bucketing and fixed SP, generate a real multimodal dataset, check the ShadowLoader's shape
# predictions against materialised tensors, run the reference log-prob pass of a tiny random
# Qwen2.5-VL over 4 gloo processes with FlexUlysses, and compare data-loading paths.
# Outputs go to ./runs/demo/ (plans, plots, log-probs).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install.sh
export DS_ACCELERATOR=cpu RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
out=runs/demo
mkdir -p "$out"
flexrl=".venv/bin/flexrl"
step() { echo; echo "=== $* ==="; }

step "1/6 FlexUlysses planner: one video-heavy GRPO step (64 prompts x 8 samples) on 32 ranks"
$flexrl make-workload --mix video-heavy --num 512 --seed 0 --out "$out/workload.json"
$flexrl plan --workload "$out/workload.json" --world-size 32 --model qwen2.5-vl-7b --p-max 8 \
  --out "$out/plan.json"

step "2/6 Simulated comparison (paper regime: 64 prompts, 32 ranks): bucketing vs fixed SP vs FlexUlysses"
$flexrl simulate --mix image-heavy --world-size 32 --gbs 64 --n-samples 1 --seeds 5 \
  --plot "$out/simulate.png"

step "3/6 A small video-heavy dataset with real media (PNG/JPEG, H.264 MP4)"
$flexrl make-dataset --mix video-heavy --num 12 --scale small --seed 0 --out "$out/data"

step "4/6 A tiny random Qwen2.5-VL; ShadowLoader predicted vs materialised shapes"
$flexrl make-tiny-model --out "$out/tiny-vl" --arch qwen2.5-vl
$flexrl inspect-data --data "$out/data/train.jsonl" --model "$out/tiny-vl" --materialize

step "5/6 Reference log-prob pass: ShadowLoader actors feed 4 gloo processes (FlexUlysses + balanced vision tower); the parent holds no pixels"
$flexrl logprobs --model "$out/tiny-vl" --data "$out/data/train.jsonl" --response-key answer \
  --nproc 4 --p-max 4 --loader shadow --actors 2 --cpus-per-actor 0.5 --config ds_configs/cpu_test.json \
  --plan-out "$out/logprob_plan.json" --out "$out/logprobs.jsonl"
echo "wrote $(wc -l < "$out/logprobs.jsonl") records of log-probs to $out/logprobs.jsonl"

step "6/6 Data loading: centralised controller vs ShadowLoader (Ray actors); tiny media decode in ms, so compare bytes and RSS here, speed in docs/BENCHMARKS.md"
$flexrl bench loader --data "$out/data/train.jsonl" --model "$out/tiny-vl" --global-batch 4 \
  --steps 2 --actors 2 --compute-ms 500 --plot "$out/loader.png"

echo; echo "demo finished: outputs in $out/"
