#!/usr/bin/env bash
# The FlexUlysses GPU run (2 GPUs, NCCL): equivalence tests, then `flexrl bench sp` timings.
# Run from the repository root on the GPU machine; DeepSpeed comes from .whl/ when present
# (bash ../shared/device/fetch-wheels.sh --no-ray). Results go to ${OUT:-runs/gpu}.
set -uo pipefail
out=${OUT:-runs/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/deepspeed-*.tar.gz >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && mkdir -p /tmp/ds && tar xzf .whl/deepspeed-*.tar.gz -C /tmp/ds \
    && (cd /tmp/ds/deepspeed-* && DS_BUILD_OPS=0 python3 -m pip install -q --no-deps --no-build-isolation \
        --no-index --target /tmp/site .)
fi
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__)"
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1
timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/gpu ${GPU_TEST_ARGS:-} 2>&1 | tee "$out/gpu_tests.log"
[ "${SKIP_BENCH:-0}" = 1 ] && exit 0
bench="timeout 120 python3 -m flexrl_ds bench sp --nproc 2 --iters 5 --warmup 2"
$bench --json "$out/bench_decoder.json" --plot "$out/bench_decoder.png" 2>&1 | grep -v "^\[W" | tee "$out/bench_decoder.log"
$bench --no-overlap --json "$out/bench_decoder_no_overlap.json" 2>&1 | grep -v "^\[W" | tee "$out/bench_no_overlap.log"
$bench --layer attention --json "$out/bench_attention.json" 2>&1 | grep -v "^\[W" | tee "$out/bench_attention.log"
$bench --layer attention --long 16384 --num-short 160 --short-range 300,1500 \
  --json "$out/bench_attention_image_heavy.json" 2>&1 | grep -v "^\[W" | tee "$out/bench_image_heavy.log"
$bench --long 98304,16384 --num-short 48 --json "$out/bench_decoder_long.json" 2>&1 | grep -v "^\[W" \
  | tee "$out/bench_decoder_long.log"
