#!/usr/bin/env bash
# The main job on a fresh CPU machine: install, then run the most complete pipeline that exists.
# Outputs go to ./runs/demo/. Each stage prints what it does.
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

step "1. FlexUlysses planner: a video-heavy GRPO step on 32 ranks"
$flexrl make-workload --mix video-heavy --num 512 --seed 0 --out "$out/workload.json"
$flexrl plan --workload "$out/workload.json" --world-size 32 --model qwen2.5-vl-7b --p-max 8 --out "$out/plan.json"

step "2. Simulated comparison: bucketing vs fixed SP vs FlexUlysses"
$flexrl simulate --mix image-heavy --world-size 32 --gbs 64 --n-samples 8 --seeds 3 --plot "$out/simulate.png"
