"""`flexrl simulate --world-sizes`: one projected step-time table over GPU counts, labelled as a
projection, each size the same as a plain simulate run of that size."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexrl_ds.bench.simulator import default_extra_p_maxes, format_projection, project, simulate
from flexrl_ds.cli.main import main
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import load_cost_model

SHIPPED = Path(__file__).resolve().parents[3] / "ds_configs" / "calibration" / "2xh200_bf16.json"
COST = load_cost_model("qwen2.5-vl-7b", SHIPPED)


def test_each_size_is_a_simulation_at_that_size_with_weak_scaling():
    proj = project("image-heavy", (16, 8), 8, 1, 1, COST, SPConfig())
    assert [run.world_size for run in proj.runs] == [8, 16]
    assert [run.gbs for run in proj.runs] == [8, 16]  # the same prompts per GPU
    alone = simulate("image-heavy", 16, 16, 1, 1, COST, SPConfig(), extra_p_maxes=default_extra_p_maxes(16, SPConfig(), COST))
    assert set(proj.runs[1].means) == set(alone.means) >= {"SP=8", "FlexUlysses", "FlexUlysses p<=16"}
    for method, values in alone.means.items():
        for key in ("step_time_s", "mean_compute_s", "mean_exposed_all_to_all_s", "idle_s"):
            assert proj.runs[1].means[method][key] == values[key]
    fixed = project("image-heavy", (8, 16), 8, 1, 1, COST, SPConfig(), weak_scaling=False)
    assert [run.gbs for run in fixed.runs] == [8, 8]


def test_breakdown_sums_to_the_step_and_the_table_says_projection():
    proj = project("video-heavy", (8, 16), 8, 1, 1, COST, SPConfig())
    for run in proj.runs:
        for values in run.means.values():
            parts = values["mean_compute_s"] + values["mean_exposed_all_to_all_s"] + values["idle_s"]
            assert parts == pytest.approx(values["step_time_s"], rel=1e-9)
    text = format_projection(proj)
    assert text.startswith("PROJECTION") and "(measured)" in text and "(assumed)" in text
    assert "spans 2 nodes" in text  # the p<=16 row at 16 GPUs crosses the node boundary


def test_needs_a_calibrated_model():
    with pytest.raises(ValueError, match="calibration"):
        project("image-heavy", (8,), 8, 1, 1, load_cost_model("qwen2.5-vl-7b"), SPConfig())


def test_cli_sweep_with_network_overrides(capsys, tmp_path):
    base = ["simulate", "--mix", "image-heavy", "--world-sizes", "8,16", "--gbs", "8", "--n-samples", "1",
            "--seeds", "1", "--calibration", str(SHIPPED), "--json"]
    assert main(base) == 0
    fast = json.loads(capsys.readouterr().out)
    assert main(base + ["--gpus-per-node", "4", "--network-GBps", "1", "--network-latency-us", "500"]) == 0
    slow = json.loads(capsys.readouterr().out)
    assert fast["projection"] is True and len(fast["runs"]) == 2
    step = lambda out, m: out["runs"][1]["methods"][m]["step_time_s"]  # noqa: E731
    assert step(slow, "SP=8") > step(fast, "SP=8")  # 8-GPU groups now span two 4-GPU nodes
    assert step(slow, "SP=4") == step(fast, "SP=4")  # inside a node: no network term
    assert step(slow, "FlexUlysses") <= step(slow, "SP=8")  # the planner sees the slow network too
    plot = tmp_path / "p.png"
    assert main(base[:-1] + ["--plot", str(plot)]) == 0
    assert "PROJECTION" in capsys.readouterr().out and plot.stat().st_size > 0
    assert main(["simulate", "--mix", "image-heavy", "--world-size", "8", "--world-sizes", "8", "--gbs", "8"]) != 0
    assert "one of --world-size or --world-sizes" in capsys.readouterr().err
