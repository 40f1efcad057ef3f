#!/usr/bin/env bash
# The main job on a fresh CPU machine: install, then a tiny GRPO run end to end.
#   data:   a generated dataset with images and H.264 videos (flexrl make-dataset --task keyword):
#           each prompt asks the model to answer with one word, which is the record's answer;
#   model:  a tiny random Qwen2.5-VL (flexrl make-tiny-model; `scripts/demo.sh --arch qwen3-vl` for a
#           tiny Qwen3-VL: timestamped video frame groups, DeepStack);
#   reward: built-in "keyword_letters": half the share of the response's letters that are letters
#           of the keyword, half the share of the response spelled by copies of the keyword. Random
#           text earns ~0.1; a model that writes the keyword earns 1 — a task a random model can
#           learn on a CPU in minutes, nothing more;
#   run:    flexrl train with ds_configs/grpo_tiny_cpu.json: 4 DeepSpeed ZeRO-3 policy ranks (gloo)
#           with FlexUlysses degrees up to 4 (the planner chose 1 and 2 in the recorded runs), a
#           reference model, HF-generate rollouts colocated in the ranks, ShadowLoader preprocessing
#           actors on a local Ray; 50 GRPO steps, a checkpoint and an HF export every 10.
# Outputs: runs/demo/run/ (metrics.jsonl, metrics.png, tensorboard/, rollouts/, plans/, checkpoints/, hf/).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install.sh
export DS_ACCELERATOR=cpu RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
arch=qwen2.5-vl
if [ "${1:-}" = "--arch" ]; then arch=$2; fi
out=runs/demo
[ "$arch" = qwen2.5-vl ] || out=runs/demo-$arch
rm -rf "$out/run"
mkdir -p "$out"
flexrl=".venv/bin/flexrl"
step() { echo; echo "=== $* ==="; }

step "1/3 A tiny random $arch and a video-heavy keyword dataset with real media"
[ -f "$out/tiny-vl/config.json" ] || $flexrl make-tiny-model --out "$out/tiny-vl" --arch "$arch"
[ -f "$out/data/train.jsonl" ] || $flexrl make-dataset --mix video-heavy --num 12 --scale medium --seed 0 \
  --task keyword --out "$out/data"

step "2/3 GRPO: 50 steps on 4 ZeRO-3 ranks (FlexUlysses), rollouts, rewards, checkpoints"
$flexrl train --config ds_configs/grpo_tiny_cpu.json --model "$out/tiny-vl" --data "$out/data/train.jsonl" \
  --out "$out/run"

step "3/3 Reward over the run"
.venv/bin/python - "$out/run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
first, last = rows[:5], rows[-5:]
mean = lambda rs: sum(r["reward_mean"] for r in rs) / len(rs)
print(f"reward: first 5 steps {mean(first):.3f}, last 5 steps {mean(last):.3f} "
      f"({len(rows)} steps; per step in metrics.jsonl, plot in metrics.png)")
degrees = sorted({int(d) for r in rows for d in r["degrees"]})
print(f"FlexUlysses degrees used: {degrees}; mean attention balance {sum(r['attention_balance'] for r in rows) / len(rows):.3f}")
PY
echo; echo "demo finished: outputs in $out/run/ (HF export: $out/run/hf/step_49)"
