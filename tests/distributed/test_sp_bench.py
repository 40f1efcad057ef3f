"""`flexrl bench sp`: plans it compares, its table, argument errors, and one tiny end-to-end CPU run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexrl_ds.bench.sp_bench import SPBenchConfig, format_table, make_plans, skewed_lengths
from flexrl_ds.cli.main import main
from flexrl_ds.planning.plan import validate_plan

ROOT = Path(__file__).resolve().parents[2]


def test_compared_plans_are_valid_and_differ_as_intended():
    config = SPBenchConfig(long_tokens=(40000,), num_short=20)
    lengths = skewed_lengths(config)
    plans = make_plans(lengths, world_size=4, config=config)
    assert set(plans) == {"flex", "bucketing", "fixed SP=2"}
    for plan, plan_lengths in plans.values():
        validate_plan(plan, list(plan_lengths))
    assert {p.degree for p in plans["bucketing"][0].packs} == {1}
    assert {p.degree for p in plans["fixed SP=2"][0].packs} == {2}
    flex = plans["flex"][0]
    video_pack = next(p for p in flex.packs if "video0" in p.sequences)
    assert video_pack.degree > 1  # the long video is sharded, images are not all sharded
    assert min(p.degree for p in flex.packs) == 1


def test_table_names_every_system():
    record = {"world_size": 2, "device": "cpu", "num_sequences": 3, "total_tokens": 30, "longest": 20,
              "config": {"layer": "decoder", "shape": "tiny", "dtype": "float32"},
              "systems": [{"name": n, "median_ms": ms, "step_ms": [ms], "max_local_tokens": 15,
                           "min_local_tokens": 15, "degrees": {"1": 2}} for n, ms in
                          (("flex", 10.0), ("bucketing", 15.0))]}
    table = format_table(record)
    assert "flex" in table and "bucketing" in table and "1.50x" in table


@pytest.mark.parametrize("argv,needle", [
    (["--short-range", "5"], "--short-range"),
    (["--long", "10,x"], "--long"),
    (["--shape", "huge"], "--shape"),
])
def test_bad_arguments_are_user_errors(argv, needle, capsys):
    assert main(["bench", "sp", *argv]) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_bench_sp_end_to_end_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "sp.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "FLEXRL_FORCE_CPU": "1"}
    for name in ("RANK", "WORLD_SIZE"):
        env.pop(name, None)
    command = [sys.executable, "-m", "flexrl_ds", "bench", "sp", "--nproc", "2", "--shape", "tiny", "--long",
               "300", "--num-short", "6", "--short-range", "10,60", "--iters", "1", "--warmup", "0",
               "--json", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert [s["name"] for s in record["systems"]] == ["flex", "bucketing", "fixed SP=2"]
    assert all(s["median_ms"] > 0 for s in record["systems"])
    assert "fixed SP=2" in done.stdout
