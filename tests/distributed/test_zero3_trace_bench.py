"""`flexrl bench zero3-trace` (flexrl_ds/bench/zero3_trace_bench.py) in a process of its own: one
engine per reuse distance, each timed over its passes. Its pure parts: tests/unit/bench."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_bench_times_every_pass_of_one_engine_per_distance():
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-m", "flexrl_ds", "bench", "zero3-trace", "--blocks", "6",
                             "--passes", "3", "--reuse", "1e9,0"], capture_output=True, text=True, env=env,
                            cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "6 blocks of width 64 (25 modules)" in result.stdout
    progress = [line for line in result.stdout.splitlines() if line.startswith("bench zero3-trace: reuse distance")]
    assert [line.split(":")[1].strip() for line in progress] == ["reuse distance 1e+09", "reuse distance 0"]
    for line in progress:
        seconds = [float(value) for value in line.split(":")[2].removesuffix(" s").split(",")]
        assert len(seconds) == 3 and all(value > 0 for value in seconds)
    rows = [line.split() for line in result.stdout.splitlines() if line.strip().startswith(("1e+09 ", "0 "))]
    assert [row[0] for row in rows] == ["1e+09", "0"]
