#!/usr/bin/env bash
# The GRPO trainer on one GPU (issues 9, 10): a Qwen2.5-VL-3B-shaped model with random bf16 weights, a
# rollout backend (BACKEND=hf | vllm, default hf) colocated with the ZeRO-3 policy and reference,
# STEPS steps (default 2) on images and videos. vLLM: bring it first (../shared/device/README.md;
# tests/gpu/run_vllm_on_gpu_machine.sh shows the calls).
# Prepare on the development machine: bash ../shared/device/fetch-wheels.sh  (DeepSpeed + Ray into .whl/)
# Run there (device tool, carry .whl):  bash tests/gpu/run_trainer_on_gpu_machine.sh [OUT]
# No activation checkpointing yet: 16 sequences of a few hundred tokens per step keep activations
# within the H200 next to the ZeRO-3 states (~16 B/param). Writes OUT/run/metrics.jsonl (per-phase times, tokens/GPU/s) and OUT/summary.txt.
set -euo pipefail
out=${1:-${OUT:-/tmp/flexrl-gpu}}
mkdir -p "$out"
backend=${BACKEND:-hf}
steps=${STEPS:-2}
source tests/gpu/gpu_env.sh
export RAY_AUTH_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
work=/tmp/flexrl-trainer
mkdir -p "$work"
start=$(date +%s)
# 3B shape (Qwen2.5-VL-3B: 36 layers, 2048 wide, 16/2 heads, MLP 11008; vision 1280 x 32 blocks); the
# vocabulary is the tiny tokenizer's (~640 rows instead of 151,936), so ~2.9B parameters, not 3.8B.
[ -f "$work/m3b/config.json" ] || python3 - "$work/m3b" <<'PY'
import sys
from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model
make_tiny_model(TinyModelConfig(out_dir=sys.argv[1], hidden_size=2048, num_attention_heads=16, num_key_value_heads=2,
                                num_hidden_layers=36, intermediate_size=11008, vision_hidden_size=1280, vision_depth=32,
                                vision_num_heads=16))
PY
echo "model ready after $(( $(date +%s) - start )) s"
[ -f "$work/data-small/train.jsonl" ] || python3 -m flexrl_ds make-dataset --mix video-heavy --num 16 --scale small \
  --task keyword --seed 0 --out "$work/data-small"
python3 - "$work/config.json" "$backend" <<'PY'
import json, sys
config = json.load(open("ds_configs/grpo_tiny_cpu.json"))
config["bf16"] = {"enabled": True}
config["optimizer"]["params"]["lr"] = 1e-6
config["flexrl"]["trainer"].update(num_policy_ranks=1, num_gpus_per_rank=1, num_cpus_per_rank=4, save_every=0,
                                   save_rollouts=True, timeout_s=900.0)
config["flexrl"]["sp"].update(p_max=1)
config["flexrl"]["rollout"].update(max_response_length=128, backend=sys.argv[2])
if sys.argv[2] == "vllm":
    config["flexrl"]["rollout"]["vllm"] = {"gpu_memory_utilization": 0.3, "max_model_len": 8192,
                                           "max_images_per_prompt": 8, "max_videos_per_prompt": 4}
config["flexrl"]["data"]["loader"].update(global_batch=4, num_samples_per_prompt=4)
config["flexrl"]["data"]["pool"].update(num_actors_per_node=4, num_cpus_per_actor=1.0)
json.dump(config, open(sys.argv[1], "w"), indent=1)
PY
python3 -m flexrl_ds train --config "$work/config.json" --model "$work/m3b" --data "$work/data-small/train.jsonl" \
  --out "$out/run" --max-steps "$steps" 2>&1 | grep -v "Loading weights" | tail -40
nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee "$out/summary.txt"
cp "$work/config.json" "$out/config.json"
echo "total $(( $(date +%s) - start )) s" | tee -a "$out/summary.txt"
