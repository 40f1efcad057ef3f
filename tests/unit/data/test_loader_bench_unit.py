"""`flexrl bench loader` pieces that need no Ray: config validation, table, summary ratios."""

from __future__ import annotations

import pytest

from flexrl_ds.bench.loader_bench import LoaderBenchConfig, RunResult
from flexrl_ds.bench.loader_report import format_table, summary
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


def _bench_config(tmp_path, **options):
    data = tmp_path / "train.jsonl"
    data.write_text("")
    return LoaderBenchConfig(data=str(data), global_batches=[4], steps=1, actors=[2], **options)


def test_without_config_the_runs_get_the_loader_and_pool_they_always_had(tmp_path):
    from flexrl_ds.bench.loader_bench import run_settings
    from flexrl_ds.loader.config import LoaderConfig, PoolConfig

    data_config = _bench_config(tmp_path).data_config()
    loader_config, pool_config = run_settings(data_config, 4, 2)
    # what the bench built by hand before it read flexrl.data
    assert loader_config == LoaderConfig(global_batch=4, num_samples_per_prompt=1, seed=0)
    assert data_config.bad_record_policy == "skip"
    assert pool_config == PoolConfig(num_actors_per_node=2, num_cpus_per_actor=0.5)


def test_config_file_sets_the_loader_and_pool_and_the_bench_options_override_it(tmp_path):
    import json

    from flexrl_ds.bench.loader_bench import run_settings

    run_config = tmp_path / "ds.json"
    run_config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "flexrl": {"data": {
        "bad_record_policy": "replace", "video_fps": 1.0,
        "loader": {"global_batch": 64, "num_samples_per_prompt": 4, "seed": 7, "shuffle": False,
                   "lookahead_steps": 2, "groups_per_chunk": 3},
        "pool": {"num_actors_per_node": 9, "num_cpus_per_actor": 2.0, "probe_chunk_size": 5, "timeout_s": 30.0}}}}))
    config = _bench_config(tmp_path, run_config=str(run_config))
    data_config = config.data_config()
    assert data_config.video_fps == 1.0  # pixel settings too: the actors preprocess with them
    loader_config, pool_config = run_settings(data_config, 8, 3)
    assert (loader_config.global_batch, pool_config.num_actors_per_node) == (8, 3)  # B and K: per run
    assert (loader_config.num_samples_per_prompt, loader_config.seed, loader_config.shuffle) == (4, 7, False)
    assert (data_config.bad_record_policy, loader_config.lookahead_steps, loader_config.groups_per_chunk) == (
        "replace", 2, 3)
    assert (pool_config.num_cpus_per_actor, pool_config.probe_chunk_size, pool_config.timeout_s) == (2.0, 5, 30.0)
    overridden = _bench_config(tmp_path, run_config=str(run_config), num_samples_per_prompt=2, seed=3,
                               num_cpus_per_actor=0.25)
    loader_config, pool_config = run_settings(overridden.data_config(), 8, 3)
    assert (loader_config.num_samples_per_prompt, loader_config.seed, pool_config.num_cpus_per_actor) == (2, 3, 0.25)
    assert loader_config.lookahead_steps == 2  # what the options leave alone stays the file's
    with pytest.raises(ValueError, match="--config"):
        _bench_config(tmp_path, run_config=str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="num_samples_per_prompt"):
        _bench_config(tmp_path, num_samples_per_prompt=0)


def test_cli_passes_modes_and_config_to_the_bench(tmp_path, monkeypatch, capsys):
    import json

    import flexrl_ds.bench.loader_bench as loader_bench

    seen = []
    monkeypatch.setattr(loader_bench, "run_bench", lambda config: seen.append(config) or [])
    data = tmp_path / "train.jsonl"
    data.write_text("")
    run_config = tmp_path / "ds.json"
    run_config.write_text('{"flexrl": {"data": {"loader": {"seed": 5}}}}')
    argv = ["bench", "loader", "--data", str(data), "--global-batch", "2", "--steps", "1", "--actors", "1"]
    assert main(argv + ["--modes", "central", "shadow", "--config", str(run_config)]) == 0
    assert seen[-1].modes == ["central", "shadow"] and seen[-1].data_config().loader.seed == 5
    capsys.readouterr()
    assert main(argv + ["--json"]) == 0 and seen[-1].modes == ["none", "central", "shadow"]
    printed = json.loads(capsys.readouterr().out)
    assert printed["config"]["run_config"] is None
    assert printed["flexrl_data"]["pool"]["num_cpus_per_actor"] == 0.5  # the settings that ran, resolved
    with pytest.raises(SystemExit):
        main(argv + ["--modes", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err
