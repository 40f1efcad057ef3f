#!/usr/bin/env bash
# Install flexrl_ds and everything its CPU tests and demo need into ./.venv (idempotent).
# Every dependency, direct and transitive, is pinned by requirements/cpu-lock.txt (a constraints file;
# scripts/lock.sh refreshes it), torch to the 2.13.0 CPU build among them: an unpinned torch, asked for
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
lock=requirements/cpu-lock.txt
# Every package, direct or transitive, installs at the version the lock pins (torch's 2.13.0 CPU build
# among them); FLEXRL_UNLOCKED=1 installs the newest releases setup.cfg allows instead, to refresh the
# lock (scripts/lock.sh says how).
if [ "${FLEXRL_UNLOCKED:-0}" = 1 ] || [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ] || [ scripts/install.sh -nt "$stamp" ] \
    || [ "$lock" -nt "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  if [ "${FLEXRL_UNLOCKED:-0}" = 1 ]; then
    echo "[install] pip: unlocked (FLEXRL_UNLOCKED=1): torch==2.13.0 (CPU), the newest releases of the rest"
    constraints=$(mktemp)
    echo "torch==2.13.0" > "$constraints"
    upgrade=(--upgrade --upgrade-strategy eager)
  else
    echo "[install] pip: torch (CPU), deepspeed, ray, transformers, torchcodec, test tools at the versions of $lock"
    constraints=$lock
    upgrade=()
  fi
  # DeepSpeed builds from its sdist; DS_BUILD_OPS=0 compiles no ops (they JIT-build when used).
  DS_BUILD_OPS=0 .venv/bin/pip install -q "${upgrade[@]}" -c "$constraints" "torch==2.13.0" "deepspeed==0.19.8" \
    "ray[default]==2.60.0" "torchcodec==0.13.0" -e ".[test]"
  [ "$constraints" = "$lock" ] || rm -f "$constraints"
  # OpenRLHF's loss code is the tests' reference (tests/unit/rl/openrlhf_reference.py loads two of its
  # files by path); its dependencies (flash-attn, vLLM, other DeepSpeed/Ray pins) are not wanted here.
  .venv/bin/pip install -q --no-deps "openrlhf==0.11.2"
  touch "$stamp"
fi
