"""`flexrl bench step-cost` (flexrl_ds/bench/step_cost_bench.py) in a process of its own: it times the
engine's pass and `train_step` on the 3B module tree at tiny widths, and its sync counts show that
`train_step` reads the device no more per step than the engine's own pass plus the step's one read of
its statistics."""

from __future__ import annotations

from bench_process import run_bench_json


def test_step_cost_bench(tmp_path):
    result = run_bench_json("step-cost", tmp_path / "result.json", "--work-dir", str(tmp_path), "--prompts", "2",
                            "--response-length", "16", "--repeats", "1")
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
