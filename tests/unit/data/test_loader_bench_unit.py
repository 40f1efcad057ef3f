"""`flexrl bench loader` pieces that need no Ray: config validation, table, summary ratios."""

from __future__ import annotations

import pytest

from flexrl_ds.bench.loader_bench import LoaderBenchConfig, RunResult, format_table, summary
from flexrl_ds.cli.main import main


def _result(mode, batch, actors, exposed, ctrl_bytes, rss_start, rss_peak):
    return RunResult(mode=mode, global_batch=batch, actors=actors, steps=2, compute_ms=100.0, exposed_ms=exposed,
                     exposed_ms_max=exposed, worker_wait_ms=0.0, controller_loader_ms=1.0,
                     controller_bytes_per_step=ctrl_bytes, pixel_bytes_per_step=1e6,
                     controller_rss_start_mb=rss_start, controller_rss_peak_mb=rss_peak, total_rss_peak_mb=900.0,
                     samples_per_s=3.0)


def test_summary_compares_the_largest_actor_count_with_central():
    results = [_result("central", 4, 0, 200.0, 1e6, 300, 500), _result("shadow", 4, 1, 50.0, 2e3, 300, 301),
               _result("shadow", 4, 2, 10.0, 1e3, 300, 302)]
    ratios = summary(results)["4"]
    assert ratios["exposed_ratio"] == pytest.approx(0.05)
    assert ratios["controller_bytes_ratio"] == pytest.approx(1e-3)
    assert ratios["controller_rss_growth_mb"] == {"central": 200, "shadow": 2}
    table = format_table(results)
    assert table.count("\n") == 3 and "central" in table


def test_config_errors_name_the_option(tmp_path):
    with pytest.raises(ValueError, match="--data"):
        LoaderBenchConfig(data=str(tmp_path / "none.jsonl"), global_batches=[2], steps=1, actors=[1])
    data = tmp_path / "train.jsonl"
    data.write_text("")
    with pytest.raises(ValueError, match="--compute-ms"):
        LoaderBenchConfig(data=str(data), global_batches=[2], steps=1, actors=[1], compute_ms=-1)
    assert main(["bench", "loader", "--data", str(tmp_path / "none.jsonl"), "--global-batch", "2",
                 "--steps", "1", "--actors", "1"]) == 2
