#!/usr/bin/env bash
# Install flexrl_ds and everything its CPU tests and demo need into ./.venv (idempotent).
# torch is pinned to the 2.13.0 CPU build through a constraint file: an unpinned torch, asked for
# directly or by another package, would pull a multi-GB CUDA build.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if ! command -v ffmpeg >/dev/null 2>&1 || ! ldconfig -p | grep -q libavcodec; then
  echo "[install] apt: ffmpeg (torchcodec's CPU decoder libraries)"
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq ffmpeg >/dev/null
  else sudo apt-get update -qq && sudo apt-get install -y -qq ffmpeg >/dev/null; fi
fi
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[install] creating .venv"
  "$python" -m venv .venv
fi
stamp=.venv/.flexrl-installed
if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ] || [ scripts/install.sh -nt "$stamp" ]; then
  echo "[install] pip: torch==2.13.0 (CPU), deepspeed, ray, transformers, torchcodec==0.13.0, test tools"
  .venv/bin/pip install -q --upgrade pip
  constraints=$(mktemp)
  echo "torch==2.13.0" > "$constraints"
  # DeepSpeed builds from its sdist; DS_BUILD_OPS=0 compiles no ops (they JIT-build when used).
  DS_BUILD_OPS=0 .venv/bin/pip install -q -c "$constraints" "torch==2.13.0" "deepspeed==0.19.8" \
    "ray[default]==2.60.0" "torchcodec==0.13.0" -e ".[test]"
  rm -f "$constraints"
  # OpenRLHF's loss code is the tests' reference (tests/unit/rl/openrlhf_reference.py loads two of its
  # files by path); its dependencies (flash-attn, vLLM, other DeepSpeed/Ray pins) are not wanted here.
  .venv/bin/pip install -q --no-deps "openrlhf==0.11.2"
  touch "$stamp"
fi
