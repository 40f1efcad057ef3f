#!/usr/bin/env bash
# The FlexUlysses GPU run (2 GPUs, NCCL): equivalence tests, then `flexrl bench sp` timings.
# Run from the repository root on the GPU machine; DeepSpeed comes from .whl/ when present
# (bash ../shared/device/fetch-wheels.sh --no-ray). Results go to ${OUT:-runs/gpu}.
set -uo pipefail
out=${OUT:-runs/gpu}
mkdir -p "$out"
source tests/gpu/gpu_env.sh
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
