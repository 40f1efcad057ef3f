#!/usr/bin/env bash
# Refresh the pinned versions that scripts/install.sh installs (requirements/cpu-lock.txt): every direct
# and transitive dependency of the CPU install, from this checkout's .venv (`pip freeze --all`, pip and flexrl_ds
# themselves left out). Or, with --gpu FREEZE, the GPU machine's (requirements/gpu-lock.txt) from a
# `python3 -m pip freeze` taken there after installing the extras.
#
# Moving to newer releases:
#   FLEXRL_UNLOCKED=1 bash scripts/install.sh   # install without the lock, upgrading every dependency
#   bash scripts/lock.sh                        # write what got installed into requirements/cpu-lock.txt
#   bash scripts/test.sh                        # the suite on the new versions; commit the lock with it
# A local version label (torch's "+cpu", "+cu130") is dropped: `==2.13.0` accepts the build the index serves.
# Usage: bash scripts/lock.sh [--gpu FREEZE_FILE]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [[ ${1:-} == --gpu ]]; then
  freeze=$(cat "${2:?--gpu needs the file a pip freeze on the GPU machine wrote}")
  lock=requirements/gpu-lock.txt
  what="the GPU machine's Python packages with the gpu extras (vllm, DeepSpeed, Ray) installed, from $(basename "$2")"
else
  freeze=$(.venv/bin/python -m pip freeze --all --exclude-editable)  # --all: setuptools is a dependency (torch, tensorboard)
  lock=requirements/cpu-lock.txt
  what="every package of the CPU install (scripts/install.sh), direct and transitive, from .venv's pip freeze"
fi
{
  echo "# Pinned versions: $what."
  echo "# Written by scripts/lock.sh on $(date -u +%Y-%m-%d); refresh it with that script, never by hand."
  printf '%s\n' "$freeze" | grep -E '^[A-Za-z0-9._-]+==' | grep -viE '^(flexrl[-_]ds|pip)==' | sed -E 's/\+[A-Za-z0-9.]+$//'
} > "$lock.tmp"
mv "$lock.tmp" "$lock"
echo "scripts/lock.sh: $(grep -vc '^#' "$lock") packages pinned in $lock"
