"""`flexrl bench rollout`'s timing and bookkeeping (the engines themselves need a GPU: tests/gpu)."""

import pytest

from flexrl_ds.bench import rollout_bench
from flexrl_ds.bench.rollout_bench import RolloutBenchConfig, RolloutBenchResult


class _CountingEngine:
    def __init__(self):
        self.events = []

    def reset_caches(self):
        self.events.append("reset")

    def generate(self, requests):
        self.events.append(f"generate {len(requests)}")
        return 7 * len(requests)


def test_every_timing_starts_from_reset_caches_after_one_warm_up():
    engine = _CountingEngine()
    timings, tokens = rollout_bench._timed_tokens(engine, list(range(5)), engine.generate, repeats=3)
    assert engine.events == ["generate 2"] + ["reset", "generate 5"] * 3
    assert len(timings) == 3 and all(t >= 0 for t in timings) and tokens == 35


def test_an_engine_is_reported_by_its_best_timing_and_keeps_all():
    result = RolloutBenchResult(config={}, device="cpu")
    line = result.record("vllm", [2.4, 2.0, 2.2], tokens=16384)
    assert result.seconds["vllm"] == min([2.4, 2.0, 2.2])
    assert result.tokens_per_s["vllm"] == pytest.approx(16384 / 2.0)
    assert result.timings_s["vllm"] == [2.4, 2.0, 2.2]
    assert "best of 2.40, 2.00, 2.20 s" in line


def test_repeats_must_be_positive():
    with pytest.raises(ValueError, match="--repeats: must be at least 1, got 0"):
        RolloutBenchConfig(repeats=0)


def test_the_cli_repeats_and_kv_caches_reach_the_bench(monkeypatch, capsys):
    from flexrl_ds.cli.main import build_parser

    seen = []

    def fake_bench(config):  # the real one needs a GPU
        seen.append(config)
        return RolloutBenchResult(config={}, device="none")

    monkeypatch.setattr(rollout_bench, "run_rollout_bench", fake_bench)
    args = build_parser().parse_args(["bench", "rollout", "--shape", "tiny", "--repeats", "5",
                                      "--hf-kv-caches", "static"])
    assert args.func(args) == 0
    assert [(config.repeats, config.hf_kv_caches) for config in seen] == [(5, ("static",))]


class _SleepingEngine(_CountingEngine):
    def sleep(self):
        self.events.append("sleep")

    def wake(self):
        self.events.append("wake")


def test_after_sleep_every_timing_follows_a_sleep_and_a_wake_as_between_training_steps():
    engine = _SleepingEngine()
    timings, tokens = rollout_bench._timed_tokens(engine, list(range(5)), engine.generate, repeats=2,
                                                  after_sleep=True)
    assert engine.events == ["generate 2"] + ["sleep", "wake", "reset", "generate 5"] * 2
    assert len(timings) == 2 and tokens == 35


def test_engines_after_sleep_are_compared_with_hf_after_sleep_and_warm_ones_with_warm_hf():
    from flexrl_ds.cli.rollout import speedup_lines

    lines = speedup_lines({"hf": 100.0, "hf_after_sleep": 50.0, "vllm": 400.0, "vllm_after_sleep": 350.0})
    assert lines == ["vllm / hf = 4.0x", "vllm_after_sleep / hf_after_sleep = 7.0x"]
    assert speedup_lines({"vllm": 400.0}) == []


def test_hf_kv_caches_must_be_known_modes():
    with pytest.raises(ValueError, match="--hf-kv-caches: dynamic and/or static, each once, got paged"):
        RolloutBenchConfig(hf_kv_caches=("paged",))
    with pytest.raises(ValueError, match="each once, got static,static"):
        RolloutBenchConfig(hf_kv_caches=("static", "static"))
    assert RolloutBenchConfig(backends=("vllm",), hf_kv_caches=()).backends == ("vllm",)


def _saved(tmp_path):
    result = RolloutBenchResult(config={"shape": "7b", "prompts": 4, "prompt_len": 8, "new_tokens": 16}, device="x")
    for name, timings in (("hf", [8.0, 4.0]), ("vllm", [1.0, 2.0]), ("hf_after_sleep", [5.0, 6.0]),
                          ("vllm_after_sleep", [1.0, 1.25])):
        result.record(name, timings, tokens=64)
    path = tmp_path / "result.json"
    rollout_bench.write_result(result, str(path))
    return path


def test_rows_of_a_saved_result_give_each_timings_rate_warm_engines_first(tmp_path):
    import json

    from flexrl_ds.bench.rollout_plot import engine_rows, speedups

    result = json.loads(_saved(tmp_path).read_text())
    rows = engine_rows(result)
    assert [name for name, *_ in rows] == ["hf", "vllm", "hf_after_sleep", "vllm_after_sleep"]
    assert rows[0][2] == [64 / 8.0, 64 / 4.0] and rows[0][3] == 64 / 4.0
    assert rows[3][1] == "vLLM, the trainer's engine, after sleep and wake"
    assert speedups(result["tokens_per_s"]) == {"vllm": ("hf", 4.0), "vllm_after_sleep": ("hf_after_sleep", 5.0)}


def test_a_saved_result_is_reported_and_plotted_without_a_gpu(tmp_path, capsys):
    from flexrl_ds.cli.main import build_parser

    plot = tmp_path / "rollout.png"
    args = build_parser().parse_args(["bench", "rollout", "--from-json", str(_saved(tmp_path)), "--plot", str(plot)])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "vllm / hf = 4.0x" in out and "vllm_after_sleep / hf_after_sleep = 5.0x" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_json_that_is_no_result_is_named(tmp_path):
    from flexrl_ds.cli.main import build_parser

    other = tmp_path / "other.json"
    for text, message in (('{"rows": []}', "other.json: not a `flexrl bench rollout` result"),
                          ('{"tokens_per_s": {}, "seconds": {}, "timings_s": {}}', "other.json: no engine timed"),
                          ('{"tokens_per_s": {"hf": 1.0}, "seconds": {"hf": 2.0}, "timings_s": {}}',
                           "engines without timings: hf")):
        other.write_text(text)
        args = build_parser().parse_args(["bench", "rollout", "--from-json", str(other)])
        with pytest.raises(SystemExit, match=message):
            args.func(args)


def test_engines_are_set_against_the_floor_and_hf_against_what_the_floor_allows(tmp_path, capsys):
    import json

    from flexrl_ds.bench.rollout_plot import floor_lines
    from flexrl_ds.cli.main import build_parser

    path = _saved(tmp_path)
    result = json.loads(path.read_text())
    assert floor_lines(result) == []  # results written before the floor existed
    result["floor_s"] = {"prefill": 0.25, "decode": 0.25, "total": 0.5}
    path.write_text(json.dumps(result))
    lines = floor_lines(result)
    assert "vllm runs at 50% of the roofline floor (0.50 s)" in lines  # best 1.0 s
    assert "hf runs at 12% of the roofline floor (0.50 s)" in lines  # best 4.0 s
    assert lines[-2:] == ["no engine can be more than 8.0x hf on this batch and GPU",
                          "no engine can be more than 10.0x hf_after_sleep on this batch and GPU"]
    plot = tmp_path / "rollout.png"
    args = build_parser().parse_args(["bench", "rollout", "--from-json", str(path), "--plot", str(plot)])
    assert args.func(args) == 0
    assert "no engine can be more than 8.0x hf" in capsys.readouterr().out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
