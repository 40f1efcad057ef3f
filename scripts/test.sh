#!/usr/bin/env bash
# Set up a fresh machine (scripts/install.sh), lint and type-check (ruff, mypy), and run the whole CPU
# test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
bash scripts/install.sh
export DS_ACCELERATOR=cpu RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Lint and types first (config in pyproject.toml): either failing fails the command.
echo "[test] ruff check"
.venv/bin/ruff check .
echo "[test] mypy (flexrl_ds/)"
.venv/bin/mypy
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then
  echo "scripts/test.sh: pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$rc"
