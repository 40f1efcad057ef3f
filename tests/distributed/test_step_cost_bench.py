"""`flexrl bench step-cost` (flexrl_ds/bench/step_cost_bench.py) in a process of its own: it times the
engine's pass and `train_step` on the 3B module tree at tiny widths, and its sync counts show that
`train_step` reads the device no more per step than the engine's own pass plus the step's one read of
its statistics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_step_cost_bench(tmp_path):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(name, None)
    completed = subprocess.run(
        [sys.executable, "-m", "flexrl_ds", "bench", "step-cost", "--work-dir", str(tmp_path), "--prompts", "2",
         "--response-length", "16", "--repeats", "1", "--json", str(tmp_path / "result.json")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["micro_batches"] >= 1 and result["tokens"] > 0
    for way in ("zero3 forward+backward", "engine.step", "train_step"):
        assert result["seconds"][way] > 0, way
    syncs = result["syncs"]
    assert sum(syncs["rank_grpo_loss"].values()) == 1  # its statistics, read once
    # per micro-batch: train_step's reads beyond the engine's pass and step are the step's one read of the
    # summed statistics, spread over its micro-batches
    engine_reads = sum(syncs["zero3 pass + engine.step"].values())
    step_reads = sum(syncs["train_step"].values())
    assert step_reads - engine_reads <= 1 / result["micro_batches"] + 1e-9, syncs
