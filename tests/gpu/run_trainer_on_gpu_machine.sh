#!/usr/bin/env bash
# The GRPO trainer on one GPU (issues 9, 10): a Qwen2.5-VL-shaped model with random bf16 weights, a
# rollout backend (BACKEND=hf | vllm, default hf) colocated with the ZeRO-3 policy and reference,
# STEPS steps (default 2) on images and videos. The run config is the shape's shipped one-GPU file of
# the card, ds_configs/grpo_vl{3b,7b}_1x{h200,h100}.json (CARD below), with the switches below on top.
#   SHAPE=3b (default): with the H200 file all ZeRO-3 states on the GPU.
#   SHAPE=qwen3-vl-8b | qwen3-vl-moe: Qwen3-VL-8B's layers, or Qwen3-VL-30B-A3B's at 12 of its 48 decoder
#     layers (bench/rollout_bench.py SHAPES), with ds_configs/grpo_vl8b_1xh200.json (an H200 only).
#   LAYERS=n: the shape at n decoder layers (its own model folder), e.g. the MoE reduced further to train on
#     an 80 GB card: `SHAPE=qwen3-vl-moe LAYERS=4 RUN_CONFIG=ds_configs/grpo_vl3b_1xh100.json`.
#   RUN_CONFIG=path: another run config (e.g. the 8B file under SHAPE=7b: the Qwen2.5-VL-7B baseline of
#     the Qwen3-VL runs, same settings).
#   CARD=h100|h200: which shipped one-GPU file, ds_configs/grpo_vl{3b,7b}_1x{h100,h200}.json (default: h100
#     on a GPU of under 100 GiB, else h200). The 80 GB files (ds_configs/README.md) checkpoint activations, cap
#     a micro-batch at 16,384 tokens per rank, move the policy's states off the GPU while vLLM generates and
#     offload part of the optimizer (3B: 30%; 7B: 60%, and no reference model: flexrl.rl.init_kl_coef 0).
#   VOCAB_SIZE=n: the model's vocabulary rows (default 151,936: Qwen2.5-VL's, the tokenizer grown with
#     generated filler tokens, models/vocabulary.py; the runs before 2026-12-05 had the tiny tokenizer's 640).
#   SHAPE=7b: ZeRO-3 with 60% of the optimizer offloaded to pinned host memory (`offload_optimizer.ratio`,
#     `pin_memory`; host memory ~ 4 B/param of fp32 gradient buffer for all parameters + ratio x 16 B/param of
#     master weights, moments and gradients: 101 GiB in use at 0.6 for 7.1B parameters, ~132 GiB at 1.0,
#     more than the machine's 125 GiB), DeepSpeed's CPUAdam stepping there
#     (JIT-compiled on first use) and the vLLM engine dropping its weights while asleep (sleep_level 2:
#     the sync rewrites them).
#   OFFLOAD_RATIO=r: with SHAPE=7b, the share of the optimizer offloaded (default: the file's 0.6;
#     lower keeps more of it on the GPU, stepped there: docs/BENCHMARKS.md, "Memory settings and what
#     each costs").
#   COLOCATE=0: rollout engines in Ray actors of their own: the separate-engine path, its weights over
#     the weight channel. On one GPU the engine shares it with the policy rank (0.5 GPU each) and the
#     channel shares each bucket in place (CUDA IPC). On G >= 2 GPUs every rank and engine has a whole
#     GPU (G/2 policy ranks, the rest engines) and the channel is NCCL.
#   HF_KV_CACHE=static: the hf backend's KV cache allocated once per call (`flexrl.rollout.hf.kv_cache`;
#     default dynamic).
#   HF_SLEEP_LEVEL=1: the hf engine moves its weights to host memory while asleep instead of freeing
#     them (`flexrl.rollout.hf.sleep_level`, default 2: the sync after each update rewrites them all).
#   OFFLOAD_PIN=0|1: with SHAPE=7b, whether the offloaded optimizer states sit in pinned host memory
#     (`offload_optimizer.pin_memory`; default: the file's true; unpinned, the update took 11.5-12.3 s
#     instead of 6.8-7.0 s: docs/BENCHMARKS.md, "Memory settings and what each costs").
#   HOST_THREADS=n: `flexrl.trainer.host_threads_per_rank` (default 0: the node's cores less the loader
#     actors' CPUs over its policy ranks, 14 on a 16-core host with two loader actors; the GPU files'
#     runs before 2026-12-06 had 10, one per CPU a rank reserves).
#   OFFLOAD_IN_ROLLOUT=0|1: whether the policy's ZeRO-3 states that DeepSpeed can move wait in host
#     memory while the colocated engine generates (`flexrl.trainer.offload_states_in_rollout`;
#     default: the file's, off at 3B and 7B; at 3B with vLLM it took 2.3 GiB off the rollout's device
#     peak, beyond the 32 GiB that releasing torch's cache before the wake takes, for 0.6-0.7 s a step;
#     at 7B it left the step's device peak unchanged and took host memory from 98 to 114 GiB:
#     docs/BENCHMARKS.md, "Memory settings and what each costs").
#   REF_OFFLOAD=1: the reference model's parameters in pinned host memory, fetched for each of its
#     passes (`flexrl.trainer.reference_offload_param`; default off: resident on the GPU). At 7B it
#     takes ~25 GiB more host memory: with the file's ratio 0.6 Ray killed the rank for host memory;
#     use OFFLOAD_RATIO=0.5 with it (112 GiB: docs/BENCHMARKS.md, "Memory settings and what each
#     costs").
#   TEMPERATURE=t TOP_P=p TOP_K=k: the rollout's sampling (`flexrl.rollout.temperature/top_p/top_k`;
#     default: the file's 1.0, 1.0, 0). With vllm at t != 1 and a filter, rollout_logprob_diff measures
#     the filter too (RolloutConfig.logprob_diff_caveat).
#   PROMPTS=n RESPONSE_LENGTH=t: prompts per step (`flexrl.data.loader.global_batch`, each sampled
#     num_samples_per_prompt times; the generated dataset then has n records where n > 16) and
#     `flexrl.rollout.max_response_length` (default: the file's).
#   MAX_TOKENS_PER_RANK=t: `flexrl.sp.max_tokens_per_rank`; a pass whose samples together hold more
#     runs as micro-batches (planning/micro_batches.py; `micro_batches` in metrics.jsonl).
#     LOGPROB_MAX_TOKENS_PER_RANK=t: a looser cap for the no-grad log-prob passes
#     (`flexrl.sp.logprob_max_tokens_per_rank`, at least MAX_TOKENS_PER_RANK).
#   PACK_BELOW=t PACK_BUDGET=t: `flexrl.sp.h_pack` / `H_pack`: sequences under t tokens packed
#     together, into packs of at most PACK_BUDGET tokens (one attention call per pack and layer).
#   ZERO3_PERSISTENCE=n: `stage3_param_persistence_threshold` (the shipped files: 0, every parameter
#     gathered at each use; DeepSpeed's default is 100000: norms and biases stay whole).
#   ZERO3_PREFETCH=n: `stage3_prefetch_bucket_size` (DeepSpeed's default 5e7 elements; 0: no prefetch
#     along a recorded trace). ZERO3_REUSE=n: `stage3_max_reuse_distance` (the shipped files: two
#     decoder layers, 2e8 at 3B, 5e8 at 7B; DeepSpeed's default 1e9): a parameter used again within n
#     elements along the trace stays gathered; each engine's first pass on a trace walks that far
#     ahead at every module's release (docs/BENCHMARKS.md, "ZeRO-3 trace walk").
#   ZERO3_LEAF_LAYERS=0|1: `flexrl.trainer.zero3_leaf_layers` (default since 2026-12-06: 1): every decoder
#     layer and vision block a ZeRO-3 leaf (one fetch and release per layer, ~20x fewer hook calls; also in
#     UPDATE_BENCH's engine ways); 0: every module's own hooks, the runs before that date.
#     ZERO3_GRANULARITY=n: `stage3_module_granularity_threshold` (DeepSpeed's own leaf choice; at 3B no n
#     makes exactly the layers leaves: docs/notes/zero3-one-rank-host-cost.md).
#     ZERO3_MEMORY_EFFICIENT_LINEAR=0|1: `zero_optimization.memory_efficient_linear` (DeepSpeed's default 1: its
#     engine swaps torch.nn.functional.linear for a Python autograd function, process-wide; 0: torch's own).
#     ZERO3_TRACE_WARNINGS=1: `zero_optimization.log_trace_cache_warnings`,
#     DeepSpeed's line each time a pass leaves the module order it recorded (printed by rank 0 into its
#     Ray log; the lines of every worker's log copied to OUT/zero3_trace.txt).
#   PROFILE_STEP=n: torch.profiler over step n's log-prob, update and sync phases
#     (`flexrl.trainer.profile_step`): OUT/run/profile/step_n_rank_0.txt and the trace beside it, the
#     table also copied to OUT/profile_step_n_rank_0.txt. Writing them took ~140 s for a 3B step of
#     64 samples (docs/notes/one-h200-runs-2026-12-04.md, "One H200, seventeenth run"): give the
#     call that much more.
#   VISION_ATTENTION=sdpa: the vision tower's attention as transformers runs it, one SDPA call per
#     window (`flexrl.trainer.vision_attention`; default varlen: one call per layer).
#   CKPT=0|1: activation checkpointing (`flexrl.trainer.activation_checkpointing`: layers recomputed in backward;
#     default: the file's).
#   SAVE=1: write the checkpoint and HF export after the last step (off: a 3B checkpoint is ~40 GB and
#     the machine's disk is 64 GB).
#   UPDATE_BENCH=1: instead of training, `flexrl bench update` (its six ways, flexrl_ds/bench/update_bench.py) on the data's 16 prompts x 4 samples with
#     RESPONSE_LENGTH (default 350) random response tokens (checkpointed where the run config says: the 80 GB
#     files, or CKPT=1): one update's forward
#     and backward as plain transformers, as FlexUlyssesLM, and in the run config's ZeRO-3 engine
#     (OUT/update_bench.txt and .json; the whole output in OUT/update_bench.log). UPDATE_BENCH_ARGS:
#     more arguments, e.g. "--ways flexrl,zero3 --repeats 2". UPDATE_BENCH_PROFILE=1: one more run of
#     each way under torch.profiler, a table each split by region (vision tower, decoder, lm_head, loss,
#     backward, optimizer step): OUT/update_profile/<way>.txt, without the traces (minutes to write).
#   LOADING=central: `flexrl.data.loading` central, the veRL-style baseline (the loader service decodes
#     each step when asked and ships every pixel) instead of the ShadowLoader; metrics.jsonl `loader`
#     has the exposed data time, the bytes through the controller and the peak RSS of both sides.
#   ABLATION=1: the paper's data-loading ablation (issue 40): the trainer twice on the same prompts, seeds
#     and responses, STEPS (default 3) steps each, `flexrl.data.loading` central (the veRL-style baseline:
#     the loader's controller decodes each step when asked and ships every pixel) and then shadow (the
#     ShadowLoader), on NExTQA-like clips (`make-dataset --mix video-heavy --scale nextqa`: 20-60 s,
#     360p-720p, 30 fps, ABLATION_RECORDS records, default 32 or STEPS x PROMPTS where more, encoded on
#     this host by OpenCV in one process per core: ~20-45 s for 32-64 records, estimated from the 2-core
#     VM's encoding rate); the frames the model sees stay within the model's processor budget (2 fps, at
#     most 64 frames of at most 64x28x28 pixels). Writes OUT/central/ and OUT/shadow/ (each run's
#     metrics.jsonl, rollouts/), OUT/train_{central,shadow}.log and the table of
#     `flexrl bench ablation-report OUT/central OUT/shadow`: OUT/ablation.md (printed) and OUT/ablation.json.
#     ABLATION_RUNS="central" then ABLATION_RUNS="shadow" with the same OUT (a folder on that machine): one run a call,
#     each call with its 600 s; the report comes with the second.
#     With MODEL_ONLY=1 it builds the model and the clips only (then the ablation call has its 600 s): e.g.
#     `ABLATION=1 MODEL_ONLY=1 R` then `ABLATION=1 R` in one batch; with BACKEND=vllm, the first in the
#     call that carries .whl and the second after vLLM's install (tests/gpu/run_vllm_on_gpu_machine.sh's batch).
#   MODEL_ONLY=1: only build the model directory (a separate call, so the trainer call has its 600 s).
#   PEER=trl: TRL 1.16.0's GRPOTrainer instead of our trainer (`flexrl bench trl-peer`, flexrl_ds/bench/trl_peer.py)
#     on the same model folder, data and run config (PROMPTS, RESPONSE_LENGTH, CKPT, sampling, the reward, the
#     loader's order), STEPS steps, BACKEND=vllm: TRL's vLLM colocate mode, hf: HF generate. Its data is
#     `--mix only-image` (TRL takes no videos): run ours on the same with MIX=only-image. MICRO_BATCH=n:
#     completions per forward/backward (default the samples per prompt); TRL_PEER_ARGS: more arguments.
#     Writes OUT/trl_peer.{json,txt,log}. Bring TRL first: bash scripts/fetch-trl-wheels.sh here, carry .trl
#     and start the command with `bash .trl/install.sh &&` (its lines say how with vLLM).
#   MIX=image-heavy|video-heavy|only-video|only-image: the generated data's mix (default video-heavy; only-image
#     under PEER=trl).
# vLLM: bring it first (../shared/device/README.md; tests/gpu/run_vllm_on_gpu_machine.sh shows the calls).
# Prepare on the development machine: bash ../shared/device/fetch-wheels.sh  (DeepSpeed + Ray into .whl/)
# Run there (device tool, carry .whl):  bash tests/gpu/run_trainer_on_gpu_machine.sh [OUT]
# 16 sequences of a few hundred tokens per step keep activations within the H200 next to the ZeRO-3
# states also without activation checkpointing. Writes OUT/run/metrics.jsonl (per-phase times,
# tokens/GPU/s, peak device memory per phase), OUT/host_memory.txt (peak host memory, sampled) and OUT/summary.txt.
set -euo pipefail
out=${1:-${OUT:-/tmp/flexrl-gpu}}
mkdir -p "$out"
backend=${BACKEND:-hf}
ablation=${ABLATION:-0}
steps=${STEPS:-$([ "$ablation" = 1 ] && echo 3 || echo 2)}
shape=${SHAPE:-3b}
export CARD=${CARD:-$( [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 102400 ] \
  && echo h100 || echo h200)}
# The run config: the shape's shipped one-GPU file of the card, or RUN_CONFIG (e.g. the 8B file for the 7B
# baseline of a Qwen3-VL-8B run). The Qwen3-VL shapes have an H200 file only (ds_configs/README.md).
case "$shape" in qwen3-vl-*) size=8b ;; *) size=$shape ;; esac
export RUN_CONFIG=${RUN_CONFIG:-ds_configs/grpo_vl${size}_1x$CARD.json}
[ -f "$RUN_CONFIG" ] || { echo "no run config $RUN_CONFIG for SHAPE=$shape on CARD=$CARD: set RUN_CONFIG"; exit 2; }
echo "card: $CARD ($RUN_CONFIG)"
source tests/gpu/gpu_env.sh
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
work=/tmp/flexrl-trainer
mkdir -p "$work"
start=$(date +%s)
# The shape's decoder, vision and vocabulary (bench/rollout_bench.py SHAPES): VOCAB_SIZE rows (default
# 151,936, Qwen2.5-VL's and Qwen3-VL's: a locally built byte-level BPE grown with filler tokens,
# models/vocabulary.py; until 2026-12-05 the runs had the tiny tokenizer's ~640 rows). Weights are made
# on the GPU in bf16 and saved.
vocab=${VOCAB_SIZE:-151936}
model="$work/m$shape-v$vocab"
case "$shape" in 3b|7b) model="$model-vis112" ;; esac  # the released Qwen2.5-VL tower, not an older build
[ -n "${LAYERS:-}" ] && model="$model-l$LAYERS"  # the shape at LAYERS decoder layers
[ -f "$model/model.safetensors.index.json" ] || [ -f "$model/model.safetensors" ] || \
  python3 - "$model" "$shape" "$vocab" <<'PY'
import os, sys
import torch, transformers
from flexrl_ds.bench.rollout_bench import SHAPES
from flexrl_ds.models.tiny import ARCH_CLASSES, TinyModelConfig, make_tiny_model
shape = dict(SHAPES[sys.argv[2]], vocab_size=int(sys.argv[3]))
if os.environ.get("LAYERS"):  # a shape reduced in depth (e.g. the MoE on an 80 GB card)
    shape["num_hidden_layers"] = int(os.environ["LAYERS"])
config = TinyModelConfig(out_dir=sys.argv[1], **shape)
out = make_tiny_model(config, weights=False)
torch.manual_seed(0)
with torch.device("cuda"):
    model = getattr(transformers, ARCH_CLASSES[config.arch])._from_config(
        transformers.AutoConfig.from_pretrained(str(out)), dtype=torch.bfloat16)
model.save_pretrained(str(out))
print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters saved to {out}")
PY
echo "model ready after $(( $(date +%s) - start )) s"
[ "${MODEL_ONLY:-0}" = 1 ] && [ "$ablation" != 1 ] && exit 0
if [ "$ablation" = 1 ]; then  # NExTQA-like clips of realistic sizes, one encoding process per core
  records=${ABLATION_RECORDS:-$(( steps * ${PROMPTS:-4} > 32 ? steps * ${PROMPTS:-4} : 32 ))}
  data="$work/data-nextqa-$records"
  [ -f "$data/train.jsonl" ] || python3 -m flexrl_ds make-dataset --mix video-heavy --num "$records" \
    --scale nextqa --task keyword --seed 0 --out "$data"
  echo "data ready after $(( $(date +%s) - start )) s"
  [ "${MODEL_ONLY:-0}" = 1 ] && exit 0
else  # 16 records (the measured runs' set), or PROMPTS of them where a step asks for more; MIX: their mix
  records=$(( ${PROMPTS:-16} > 16 ? ${PROMPTS:-16} : 16 ))
  mix=${MIX:-$([ "${PEER:-}" = trl ] && echo only-image || echo video-heavy)}  # TRL's GRPOTrainer takes no videos
  data="$work/data-small-$records$([ "$mix" = video-heavy ] || echo "-$mix")"
  [ -f "$data/train.jsonl" ] || python3 -m flexrl_ds make-dataset --mix "$mix" --num "$records" --scale small \
    --task keyword --seed 0 --out "$data"
fi
python3 - "$work/config.json" "$backend" "$shape" "${COLOCATE:-1}" "$(nvidia-smi -L | wc -l)" <<'PY'
import json, os, sys
path, backend, shape, colocate, gpus = sys.argv[1:]
gpus = int(gpus)
# The shipped one-GPU config of the shape and card (ds_configs/README.md), with this run's choices on top.
config = json.load(open(os.environ["RUN_CONFIG"]))
if "PROFILE_STEP" in os.environ:  # torch.profiler over that step's log-prob, update and sync phases
    config["flexrl"]["trainer"]["profile_step"] = int(os.environ["PROFILE_STEP"])
config["flexrl"]["trainer"].update(save_every=0,
                                   save_last=os.environ.get("SAVE") == "1")  # the disk holds few checkpoints
if "CKPT" in os.environ:  # else the file's (the 80 GB files checkpoint, the H200 files do not)
    config["flexrl"]["trainer"]["activation_checkpointing"] = os.environ["CKPT"] == "1"
if "VISION_ATTENTION" in os.environ:  # varlen (one call per layer) or sdpa (per window)
    config["flexrl"]["trainer"]["vision_attention"] = os.environ["VISION_ATTENTION"]
if "LOADING" in os.environ:  # shadow (the ShadowLoader) or central (the veRL-style baseline)
    config["flexrl"]["data"]["loading"] = os.environ["LOADING"]
if os.environ.get("ABLATION") == "1":  # both runs' samples compared by `flexrl bench ablation-report`
    config["flexrl"]["trainer"]["save_rollouts"] = True
if os.environ.get("REF_OFFLOAD") == "1":  # the reference's parameters in host memory
    config["flexrl"]["trainer"]["reference_offload_param"] = True
if "OFFLOAD_IN_ROLLOUT" in os.environ:  # the policy's states in host memory while the engine generates
    config["flexrl"]["trainer"]["offload_states_in_rollout"] = os.environ["OFFLOAD_IN_ROLLOUT"] == "1"
config["flexrl"]["rollout"]["backend"] = backend
for name, cast in (("temperature", float), ("top_p", float), ("top_k", int)):
    if name.upper() in os.environ:
        config["flexrl"]["rollout"][name] = cast(os.environ[name.upper()])
for variable, section, key in (("PROMPTS", config["flexrl"]["data"]["loader"], "global_batch"),
                               ("RESPONSE_LENGTH", config["flexrl"]["rollout"], "max_response_length"),
                               ("MAX_TOKENS_PER_RANK", config["flexrl"]["sp"], "max_tokens_per_rank"),
                               ("LOGPROB_MAX_TOKENS_PER_RANK", config["flexrl"]["sp"], "logprob_max_tokens_per_rank"),
                               ("PACK_BELOW", config["flexrl"]["sp"], "h_pack"),
                               ("PACK_BUDGET", config["flexrl"]["sp"], "H_pack")):
    if variable in os.environ:
        section[key] = int(os.environ[variable])
if "OFFLOAD_RATIO" in os.environ:  # 7b: the share of the optimizer stepped on the host by CPUAdam
    config["zero_optimization"]["offload_optimizer"]["ratio"] = float(os.environ["OFFLOAD_RATIO"])
if "ZERO3_PERSISTENCE" in os.environ:  # parameters under this many elements stay whole on every rank
    config["zero_optimization"]["stage3_param_persistence_threshold"] = int(os.environ["ZERO3_PERSISTENCE"])
if "ZERO3_PREFETCH" in os.environ:  # elements gathered ahead along a recorded module trace
    config["zero_optimization"]["stage3_prefetch_bucket_size"] = int(float(os.environ["ZERO3_PREFETCH"]))
if "ZERO3_REUSE" in os.environ:  # a released parameter used again within this many elements stays gathered
    config["zero_optimization"]["stage3_max_reuse_distance"] = int(float(os.environ["ZERO3_REUSE"]))
if "ZERO3_LEAF_LAYERS" in os.environ:  # 1: each layer's parameters fetched and released as one (the default)
    config["flexrl"]["trainer"]["zero3_leaf_layers"] = os.environ["ZERO3_LEAF_LAYERS"] == "1"
if "ZERO3_MEMORY_EFFICIENT_LINEAR" in os.environ:  # 0: torch's own linear instead of DeepSpeed's autograd one
    config["zero_optimization"]["memory_efficient_linear"] = os.environ["ZERO3_MEMORY_EFFICIENT_LINEAR"] == "1"
if "ZERO3_GRANULARITY" in os.environ:  # modules this fine-grained become leaves (DeepSpeed's rule)
    config["zero_optimization"]["stage3_module_granularity_threshold"] = int(float(os.environ["ZERO3_GRANULARITY"]))
if os.environ.get("ZERO3_TRACE_WARNINGS") == "1":  # a line each time a pass leaves its recorded order
    config["zero_optimization"]["log_trace_cache_warnings"] = True
if "HOST_THREADS" in os.environ:  # threads of each policy rank's host work (0: the node's cores over its ranks)
    config["flexrl"]["trainer"]["host_threads_per_rank"] = int(os.environ["HOST_THREADS"])
if "OFFLOAD_PIN" in os.environ:  # 7b: pinned host buffers for the offloaded optimizer
    config["zero_optimization"]["offload_optimizer"]["pin_memory"] = os.environ["OFFLOAD_PIN"] == "1"
if backend == "hf":
    config["flexrl"]["rollout"].pop("vllm", None)
    config["flexrl"]["rollout"]["hf"] = {"kv_cache": os.environ.get("HF_KV_CACHE", "dynamic"),
                                         "sleep_level": int(os.environ.get("HF_SLEEP_LEVEL", "2"))}
if colocate == "0" and gpus >= 2:  # whole GPUs: the weight channel is NCCL
    config["flexrl"]["trainer"].update(colocate=False, num_policy_ranks=gpus // 2, num_gpus_per_rank=1)
    config["flexrl"]["rollout"].update(num_engines=gpus - gpus // 2, num_gpus_per_engine=1, num_cpus_per_engine=2)
elif colocate == "0":
    config["flexrl"]["trainer"].update(colocate=False, num_gpus_per_rank=0.5)
    config["flexrl"]["rollout"].update(num_engines=1, num_gpus_per_engine=0.5, num_cpus_per_engine=2)
json.dump(config, open(path, "w"), indent=1)
PY
cp "$work/config.json" "$out/config.json"
if [ "${PEER:-}" = trl ]; then  # TRL's GRPOTrainer instead of ours, on the same model folder, data and run config
  python3 -m flexrl_ds bench trl-peer --model "$model" --data "$data/train.jsonl" --config "$work/config.json" \
    --steps "$steps" --rollout "$backend" ${MICRO_BATCH:+--micro-batch "$MICRO_BATCH"} ${TRL_PEER_ARGS:-} \
    --json "$out/trl_peer.json" --text "$out/trl_peer.txt" > "$out/trl_peer.log" 2>&1 \
    || echo "bench trl-peer failed: exit $?" >> "$out/trl_peer.log"
  grep -v "Loading weights\|^INFO\|^(EngineCore" "$out/trl_peer.log" | tail -40
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee "$out/summary.txt"
  echo "total $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
  ! grep -q "bench trl-peer failed" "$out/trl_peer.log"
  exit
fi
if [ "${UPDATE_BENCH:-0}" = 1 ]; then  # the update alone: plain transformers vs FlexUlysses vs its ZeRO-3 engine
  python3 -m flexrl_ds bench update --model "$model" --data "$data/train.jsonl" --config "$work/config.json" \
    --response-length "${RESPONSE_LENGTH:-350}" --samples-per-prompt 4 $(python3 -c "import json, sys; print('--checkpointing' if json.load(open(sys.argv[1]))['flexrl']['trainer']['activation_checkpointing'] else '')" "$work/config.json") ${UPDATE_BENCH_ARGS:-} \
    $([ "${UPDATE_BENCH_PROFILE:-0}" = 1 ] && echo --profile "$out/update_profile" --profile-tables-only) \
    --json "$out/update_bench.json" > "$out/update_bench.log" 2>&1 || echo "bench update failed: exit $?" >> "$out/update_bench.log"
  grep "bench update" "$out/update_bench.log" | tee "$out/update_bench.txt"
  tail -n 15 "$out/update_bench.log"  # the failure, where there is one
  grep -q "bench update failed" "$out/update_bench.log" && exit 1
  exit 0
fi
# Peak host memory in use (MemTotal - MemAvailable), sampled every 2 s while the trainer runs.
( peak=0; while sleep 2; do used=$(awk '/MemTotal/{t=$2} /MemAvailable/{a=$2} END{print int((t-a)/1048576)}' /proc/meminfo)
  [ "$used" -gt "$peak" ] && peak=$used && echo "peak host memory in use: $peak GiB at $(( $(date +%s) - start )) s" > "$out/host_memory.txt"
  done ) &
sampler=$!
trap 'kill $sampler 2>/dev/null || true' EXIT
train() {  # $1: the run config, $2: its --out (a new run each time: flexrl train refuses an --out holding
  # another run's steps), $3: its log
  rm -rf "$2"
  python3 -m flexrl_ds train --config "$1" --model "$model" --data "$data/train.jsonl" \
    --out "$2" --max-steps "$steps" 2>&1 | tee "$3" | grep -v "Loading weights" | tail -40
}
if [ "$ablation" = 1 ]; then  # central, then shadow: the same prompts, seeds and responses
  for loading in ${ABLATION_RUNS:-central shadow}; do
    python3 -c "import json, sys; c = json.load(open(sys.argv[1])); c['flexrl']['data']['loading'] = sys.argv[2]
json.dump(c, open(sys.argv[3], 'w'), indent=1)" "$work/config.json" "$loading" "$work/config_$loading.json"
    echo "== $loading loading, after $(( $(date +%s) - start )) s"
    train "$work/config_$loading.json" "$out/$loading" "$out/train_$loading.log"
  done
  [ -d "$out/central" ] && [ -d "$out/shadow" ] && { python3 -m flexrl_ds bench ablation-report "$out/central" \
    "$out/shadow" --out "$out/ablation.md" --json "$out/ablation.json" || echo "ablation-report failed: exit $?"; }
else
  train "$work/config.json" "$out/run" "$out/train.log"
fi
if [ "${ZERO3_TRACE_WARNINGS:-0}" = 1 ]; then  # from the workers' Ray logs (the driver prints only said lines)
  grep -h "Invalidate trace cache" /tmp/ray/session_latest/logs/*.out 2>/dev/null | cut -c1-200 \
    > "$out/zero3_trace.txt" || true
  echo "ZeRO-3 trace lines: $(wc -l < "$out/zero3_trace.txt") (OUT/zero3_trace.txt)"
fi
# the profile's tables at the top of OUT: the device tool brings back only the first folder levels
for table in "$out"/run/profile/*.txt; do [ -f "$table" ] && cp "$table" "$out/profile_$(basename "$table")"; done
nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee "$out/summary.txt"
cat "$out/host_memory.txt" | tee -a "$out/summary.txt"
echo "total $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
