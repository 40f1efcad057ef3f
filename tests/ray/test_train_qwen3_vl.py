"""`flexrl train` with a tiny Qwen3-VL (timestamped multi-group videos, DeepStack) on CPU: Ray + ZeRO-3
(gloo) + ShadowLoader + FlexUlysses runs its steps, and a run resumed from the step-1 checkpoint
reproduces step 2 (samples, responses, metrics, weights), as tests/ray/test_train.py checks for Qwen2.5-VL."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from test_train import rollouts, rows, tiny_config

pytestmark = [pytest.mark.ray, pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def qwen3_assets(tmp_path_factory):
    from flexrl_ds.bench.datasets import make_dataset
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("train_qwen3")
    make_tiny_model(TinyModelConfig(out_dir=str(root / "model"), arch="qwen3-vl"))
    make_dataset(root / "data", "video-heavy", 12, "medium", seed=0, task="keyword")
    return root


def _train(root, out, resume: bool = False) -> int:
    from flexrl_ds.cli.main import main

    config = tiny_config(out.parent / f"{out.name}.json", save_every=2)
    argv = ["train", "--config", str(config), "--model", str(root / "model"), "--data", str(root / "data" / "train.jsonl"),
            "--out", str(out), "--max-steps", "3"]
    return main(argv + (["--resume"] if resume else []))


def test_qwen3_vl_trains_and_resumes_exactly(qwen3_assets, ray_session):
    import transformers

    run_a, run_b = qwen3_assets / "run_a", qwen3_assets / "run_b"
    assert _train(qwen3_assets, run_a) == 0
    metrics = rows(run_a)
    assert [r["step"] for r in metrics] == [0, 1, 2] and all(math_finite(r["loss"]) for r in metrics)
    tokenizer = transformers.AutoTokenizer.from_pretrained(qwen3_assets / "model")
    prompts = [tokenizer.decode(s["prompt_ids"]) for s in rollouts(run_a, 0)]
    assert any(" seconds><|vision_start|>" in p for p in prompts)
    (run_b / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_a / "checkpoints" / "step_1", run_b / "checkpoints" / "step_1")
    (run_b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics[:2]))
    assert _train(qwen3_assets, run_b, resume=True) == 0
    a, b = rollouts(run_a, 2), rollouts(run_b, 2)
    assert [s["response_ids"] for s in a] == [s["response_ids"] for s in b]
    for key in ("reward_mean", "loss", "kl", "grad_norm"):
        assert rows(run_b)[2][key] == pytest.approx(metrics[2][key], rel=1e-4, abs=1e-6), key
    from safetensors.torch import load_file

    weights_a, weights_b = (load_file(run / "hf" / "step_2" / "model.safetensors") for run in (run_a, run_b))
    for name in weights_a:
        torch.testing.assert_close(weights_b[name], weights_a[name], rtol=1e-5, atol=1e-6, msg=name)


def math_finite(value) -> bool:
    import math

    return isinstance(value, float) and math.isfinite(value)
