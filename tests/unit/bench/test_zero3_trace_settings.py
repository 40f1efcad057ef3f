"""flexrl_ds/bench/zero3_trace_bench.py's pure parts: its settings, its rows, its command line."""

from __future__ import annotations

import pytest

from flexrl_ds.bench.zero3_trace_bench import TraceBenchConfig, TraceBenchRow, chain_model, format_rows


def test_the_first_pass_on_the_trace_is_measured_against_the_steady_median():
    row = TraceBenchRow(1e9, [0.2, 1.5, 0.1, 0.3, 0.2])
    assert row.steady_s == 0.2
    assert row.first_on_trace_extra_s == pytest.approx(1.3)
    table = format_rows([row])
    assert "1.300" in table.splitlines()[1] and "pass 2 is the first on it" in table


def test_the_module_count_is_the_chains_own():
    config = TraceBenchConfig(blocks=5, width=8)
    assert config.trace_modules == len(list(chain_model(config.blocks, config.width).modules()))


@pytest.mark.parametrize("kwargs, named", [({"blocks": 0}, "--blocks"), ({"passes": 2}, "--passes"),
                                           ({"reuse_distances": (-1.0,)}, "--reuse"), ({"reuse_distances": ()}, "--reuse"),
                                           ({"reuse_distances": (float("inf"),)}, "--reuse")])
def test_bad_settings_are_refused_by_name(kwargs, named):
    with pytest.raises(ValueError, match=named):
        TraceBenchConfig(**kwargs)


@pytest.mark.parametrize("reuse", ["1e9,lots", "inf"])
def test_a_reuse_list_that_is_not_finite_numbers_is_refused(capsys, reuse):
    from flexrl_ds.cli.main import main

    assert main(["bench", "zero3-trace", "--reuse", reuse]) == 2
    assert "--reuse:" in capsys.readouterr().err
