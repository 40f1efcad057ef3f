"""`flexrl train` on CPU under `flexrl.data.loading` "central" (the veRL-style baseline: one controller
process decodes each step when asked and ships every pixel) against "shadow" (the ShadowLoader):
the same prompts, seeds and responses, and per step the loader's cost in metrics.jsonl `loader` —
the exposed data time, the bytes through the controller (in central mode at least every pixel the
rollout pulled, counted at the rollout's end), the controller's and the driver's peak memory; and
`flexrl bench ablation-report` over the two runs (the GPU ablation's table, issue 40), checked against
their metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from flexrl_ds.bench.datasets import make_dataset
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("loading")
    make_tiny_model(TinyModelConfig(out_dir=str(root / "model")))
    make_dataset(root / "data", "video-heavy", 6, "small", seed=1, task="keyword")
    return root


def train(assets: Path, loading: str) -> Path:
    from flexrl_ds.cli.main import main

    config = json.loads((ROOT / "ds_configs" / "grpo_tiny_cpu.json").read_text())
    config["flexrl"]["trainer"].update(num_policy_ranks=2)
    config["flexrl"]["sp"].update(p_max=2)
    config["flexrl"]["data"]["loader"].update(global_batch=2, num_samples_per_prompt=2)
    config["flexrl"]["data"]["loading"] = loading
    path = assets / f"{loading}.json"
    path.write_text(json.dumps(config))
    out = assets / f"run_{loading}"
    argv = ["train", "--config", str(path), "--model", str(assets / "model"), "--data",
            str(assets / "data" / "train.jsonl"), "--out", str(out), "--max-steps", str(STEPS)]
    assert main(argv) == 0
    return out


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _samples(out: Path, step: int) -> list[tuple]:
    lines = [json.loads(line) for line in (out / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
    return sorted((row["sample"], row["id"], tuple(row["prompt_ids"]), tuple(row["response_ids"]), row["reward"])
                  for row in lines)


@pytest.fixture(scope="module")
def runs(assets, ray_session) -> tuple[Path, Path]:
    return train(assets, "central"), train(assets, "shadow")


def test_central_and_shadow_loading_train_on_the_same_samples(runs):
    central, shadow = runs
    for step in range(STEPS):
        assert _samples(central, step) == _samples(shadow, step), step
    for out, loading in ((central, "central"), (shadow, "shadow")):
        for row in _rows(out):
            loader = row["loader"]
            assert loader["loading"] == loading
            assert loader["exposed_s"] >= row["time_s"]["data"] > 0
            assert loader["controller_peak_rss_gb"] > 0 and loader["driver_peak_rss_gb"] > 0
    for central_row, shadow_row in zip(_rows(central), _rows(shadow)):
        pulled = central_row["rollout_pixel_mb"] * 2**20
        assert pulled > 0 and shadow_row["rollout_pixel_mb"] == pytest.approx(central_row["rollout_pixel_mb"])
        # Central: every pixel any consumer got passed through the controller (the rollout's pulls
        # among them); shadow: only references did.
        assert central_row["loader"]["bytes_through_controller"] >= pulled
        assert shadow_row["loader"]["bytes_through_controller"] < 0.05 * pulled


def test_ablation_report_of_the_two_runs(runs, capsys):
    from flexrl_ds.bench.ablation import ablation_report
    from flexrl_ds.cli.main import main

    central, shadow = runs
    report = ablation_report(central, shadow)
    assert report["same_samples"] == {"compared": STEPS * 2 * 2, "differing": 0, "differing_steps": []}
    for summary, out, loading in zip(report["runs"], runs, ("central", "shadow")):
        kept = _rows(out)[1:]  # the steps after the first
        assert summary["loading"] == loading and summary["steps"] == [row["step"] for row in kept]
        exposed = sum(row["loader"]["exposed_s"] for row in kept)
        assert summary["exposed_share"] == pytest.approx(exposed / sum(row["time_s"]["step"] for row in kept))
        assert summary["phases_s"]["data"] == pytest.approx(sum(row["time_s"]["data"] for row in kept) / len(kept))
        assert summary["tokens_per_gpu_s"] == pytest.approx(sum(row["tokens_per_gpu_s"] for row in kept) / len(kept))
        assert summary["controller_mb_per_step"] == pytest.approx(
            sum(row["loader"]["bytes_through_controller"] for row in kept) / len(kept) / 2**20)
    central_summary, shadow_summary = report["runs"]
    assert central_summary["controller_mb_per_step"] > 20 * shadow_summary["controller_mb_per_step"]
    capsys.readouterr()
    assert main(["bench", "ablation-report", str(central), str(shadow)]) == 0
    printed = capsys.readouterr().out
    assert "| A: central | B: shadow |" in printed and f"the same {STEPS * 4}" in printed
