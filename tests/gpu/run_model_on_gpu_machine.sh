#!/usr/bin/env bash
# Issue 3's model-level equivalence on the GPU machine (2 GPUs, NCCL): tests/gpu/test_model_gpu.py
# (tiny Qwen2.5-VL under DeepSpeed ZeRO-3 + FlexUlysses vs single-process HF; `flexrl logprobs --nproc 2`
# vs HF log-probs). Run from the repository root there. Prepare here first:
#   bash ../shared/device/fetch-wheels.sh --no-ray          # DeepSpeed into .whl/ (git-ignored)
#   tests/gpu/run_model_on_gpu_machine.sh --make-assets      # media into .gpu_assets/ (git-ignored via
#                                                            # .git/info/exclude; the GPU machine has no video encoder)
# then run this script there with carry [".whl", ".gpu_assets"]. Logs go to ${OUT:-runs/gpu}.
set -uo pipefail
if [ "${1:-}" = --make-assets ]; then
  grep -qx '/.gpu_assets/' .git/info/exclude 2>/dev/null || echo '/.gpu_assets/' >> .git/info/exclude
  exec "${PYTHON:-.venv/bin/python}" -c "
from flexrl_ds.models.sample_data import write_scoring_dataset as w
w('.gpu_assets/zero3', num_records=7, seed=2); w('.gpu_assets/logprobs', num_records=8, seed=6)"
fi
out=${OUT:-runs/gpu}
mkdir -p "$out"
source tests/gpu/gpu_env.sh
[ -d .gpu_assets ] && export FLEXRL_GPU_ASSETS=$PWD/.gpu_assets
timeout ${GPU_TEST_TIMEOUT:-420} python3 -m pytest -q -s -p no:cacheprovider \
  tests/gpu/test_model_gpu.py ${GPU_TEST_ARGS:-} 2>&1 | grep -v "^\[W" | tee "$out/gpu_model_tests.log"
