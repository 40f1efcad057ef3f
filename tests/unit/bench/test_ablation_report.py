"""`flexrl bench ablation-report`: the figures of two runs' metrics.jsonl, checked against plain loops
over the same rows; the sample check; missing keys named. (On files the real trainer wrote:
tests/ray/test_train_loading.py.)"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from flexrl_ds.bench.ablation import PHASES, ablation_report, format_report, read_metrics
from flexrl_ds.cli.main import main


def _row(step: int, loading: str, rng: random.Random) -> dict:
    times = {phase: rng.uniform(0.1, 3.0) for phase in PHASES if phase != "step"}
    times["step"] = sum(times.values()) + rng.uniform(0.0, 0.5)
    pulls = rng.uniform(0.0, 0.5)
    return {"step": step, "time_s": times, "tokens_per_gpu_s": rng.uniform(100, 2000),
            "rollout_time_s": {"pixels": pulls, "generate": 1.0}, "inference_time_s": {"batches": rng.uniform(0, 1)},
            "rollout_pixel_mb": rng.uniform(10, 50),
            "peak_host_used_gb": {"rollout": rng.uniform(10, 40), "update": rng.uniform(10, 40)},
            "loader": {"loading": loading, "exposed_s": times["data"] + pulls,
                       "bytes_through_controller": rng.randrange(10**3, 10**8),
                       "controller_peak_rss_gb": rng.uniform(0.5, 4), "driver_peak_rss_gb": rng.uniform(0.5, 2)}}


def _run(folder: Path, loading: str, steps: int, seed: int, responses: dict[int, list[int]]) -> list[dict]:
    rng = random.Random(seed)
    rows = [_row(step, loading, rng) for step in range(steps)]
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "rollouts").mkdir()
    for step in range(steps):
        lines = [json.dumps({"sample": f"s{step}p0k{k}", "id": "r0", "prompt_ids": [1, 2],
                             "response_ids": [response, k], "reward": 0.5}) for k, response in enumerate(responses[step])]
        (folder / "rollouts" / f"step_{step}.jsonl").write_text("\n".join(lines) + "\n")
    return rows


def test_report_figures_are_the_rows_averaged_after_the_first_step(tmp_path):
    responses = {0: [5, 6], 1: [7, 8], 2: [9, 9]}
    central = _run(tmp_path / "central", "central", 3, 0, responses)
    shadow = _run(tmp_path / "shadow", "shadow", 3, 1, responses)
    report = ablation_report(tmp_path / "central", tmp_path / "shadow")
    for summary, rows in zip(report["runs"], (central, shadow)):
        kept = rows[1:]
        assert summary["steps"] == [1, 2]
        for phase in PHASES:
            assert summary["phases_s"][phase] == pytest.approx(sum(r["time_s"][phase] for r in kept) / 2)
        exposed = [r["time_s"]["data"] + r["rollout_time_s"]["pixels"] for r in kept]
        assert summary["exposed_s"] == pytest.approx(sum(exposed) / 2)
        assert summary["exposed_share"] == pytest.approx(sum(exposed) / sum(r["time_s"]["step"] for r in kept))
        assert summary["controller_mb_per_step"] == pytest.approx(
            sum(r["loader"]["bytes_through_controller"] for r in kept) / 2 / 2**20)
        assert summary["controller_peak_rss_gb"] == max(r["loader"]["controller_peak_rss_gb"] for r in kept)
        assert summary["tokens_per_gpu_s"] == pytest.approx(sum(r["tokens_per_gpu_s"] for r in kept) / 2)
        assert summary["host_peak_gb"] == max(v for r in kept for v in r["peak_host_used_gb"].values())
        assert [s["step"] for s in summary["per_step"]] == [0, 1, 2]  # every step listed
    assert report["same_samples"] == {"compared": 6, "differing": 0, "differing_steps": []}
    everything = ablation_report(tmp_path / "central", tmp_path / "shadow", all_steps=True)["runs"][0]
    assert everything["exposed_s"] == pytest.approx(sum(r["loader"]["exposed_s"] for r in central) / 3)

    text = format_report(report)
    exposed_line = next(line for line in text.splitlines() if line.startswith("| **exposed data time"))
    a, b = (report["runs"][k]["exposed_s"] for k in (0, 1))
    assert exposed_line == f"| **exposed data time (s)** | {a:.3f} | {b:.3f} | {b / a:.3g} |"
    assert "| A: central | B: shadow |" in text and "the same 6" in text


def test_report_names_differing_samples_and_missing_keys(tmp_path):
    _run(tmp_path / "a", "central", 2, 0, {0: [1, 2], 1: [3, 4]})
    _run(tmp_path / "b", "shadow", 2, 0, {0: [1, 2], 1: [3, 5]})
    report = ablation_report(tmp_path / "a", tmp_path / "b")
    assert report["same_samples"] == {"compared": 4, "differing": 1, "differing_steps": [1]}
    assert "1 of 4 differ" in format_report(report)

    rows = read_metrics(tmp_path / "a")
    del rows[1]["loader"]["exposed_s"]
    (tmp_path / "a" / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError, match=r"step 1: time_s / loader lack exposed_s"):
        ablation_report(tmp_path / "a", tmp_path / "b")
    with pytest.raises(ValueError, match="metrics.jsonl: not found"):
        read_metrics(tmp_path / "none")


def test_cli_prints_and_writes_the_table(tmp_path, capsys):
    _run(tmp_path / "central", "central", 2, 0, {0: [1], 1: [2]})
    _run(tmp_path / "shadow", "shadow", 2, 3, {0: [1], 1: [2]})
    assert main(["bench", "ablation-report", str(tmp_path / "central"), str(tmp_path / "shadow"),
                 "--out", str(tmp_path / "t" / "ablation.md"), "--json", str(tmp_path / "t" / "a.json")]) == 0
    printed = capsys.readouterr().out
    assert (tmp_path / "t" / "ablation.md").read_text() == printed
    assert json.loads((tmp_path / "t" / "a.json").read_text())["runs"][1]["loading"] == "shadow"
    assert main(["bench", "ablation-report", str(tmp_path / "central"), str(tmp_path / "none")]) == 2
    assert "not found" in capsys.readouterr().err
