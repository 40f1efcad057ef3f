"""`flexrl bench zero3-trace` (flexrl_ds/bench/zero3_trace_bench.py): one engine per reuse distance,
each timed over its passes, in a process of its own; and its input checks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from flexrl_ds.bench.zero3_trace_bench import TraceBenchConfig, TraceBenchRow, engine_config, format_rows


def test_the_bench_times_every_pass_of_one_engine_per_distance():
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, "-m", "flexrl_ds", "bench", "zero3-trace", "--blocks", "6",
                             "--passes", "3", "--reuse", "1e9,0"], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    progress = [line for line in result.stdout.splitlines() if line.startswith("bench zero3-trace: reuse distance")]
    assert [line.split(":")[1].strip() for line in progress] == ["reuse distance 1e+09", "reuse distance 0"]
    for line in progress:
        seconds = [float(value) for value in line.split(":")[2].removesuffix(" s").split(",")]
        assert len(seconds) == 3 and all(value > 0 for value in seconds)
    rows = [line.split() for line in result.stdout.splitlines() if line.strip().startswith(("1e+09 ", "0 "))]
    assert [row[0] for row in rows] == ["1e+09", "0"]


def test_each_engine_gets_its_distance_and_every_parameter_gathered_at_use():
    zero = engine_config(2e8)["zero_optimization"]
    assert zero["stage3_max_reuse_distance"] == 200_000_000 and zero["stage3_param_persistence_threshold"] == 0


def test_the_first_pass_on_the_trace_is_measured_against_the_steady_median():
    row = TraceBenchRow(1e9, [0.2, 1.5, 0.1, 0.3, 0.2])
    assert row.steady_s == 0.2
    assert row.first_on_trace_extra_s == pytest.approx(1.3)
    table = format_rows([row])
    assert "1.300" in table.splitlines()[1] and "pass 2 is the first on it" in table


@pytest.mark.parametrize("kwargs, named", [({"blocks": 0}, "--blocks"), ({"passes": 2}, "--passes"),
                                           ({"reuse_distances": (-1.0,)}, "--reuse"), ({"reuse_distances": ()}, "--reuse")])
def test_bad_settings_are_refused_by_name(kwargs, named):
    with pytest.raises(ValueError, match=named):
        TraceBenchConfig(**kwargs)


def test_a_reuse_list_that_is_not_numbers_is_refused(capsys):
    from flexrl_ds.cli.main import main

    assert main(["bench", "zero3-trace", "--reuse", "1e9,lots"]) == 2
    assert "--reuse: comma-separated numbers of elements, got '1e9,lots'" in capsys.readouterr().err
