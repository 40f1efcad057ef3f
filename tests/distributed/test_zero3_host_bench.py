"""`flexrl bench zero3-host` (flexrl_ds/bench/zero3_host_bench.py) in a process of its own: the tiny model
has the 3B shape's module tree, every setting that runs computes the plain HF model's loss, and the
counts follow from what each setting does (leaf layers: far fewer hook calls; every parameter
persistent: nothing released)."""

from __future__ import annotations

import pytest
import torch
from bench_process import run_bench_json

SETTINGS = ("shipped", "persist-all", "leaves-layers", "granularity-7m")


def _reference_loss(model_dir: str, data: str) -> float:
    """The bench's samples rebuilt, scored by a plain HF forward each: mean response NLL."""
    from flexrl_ds.bench.update_bench import UpdateBenchConfig, bench_samples
    from flexrl_ds.models.flex_model import reference_logprobs
    from flexrl_ds.models.loading import load_model, ordinary_token_bound

    model = load_model(model_dir)
    config = UpdateBenchConfig(model_dir, data, "", response_length=16, samples_per_prompt=2)
    samples = bench_samples(config, ordinary_token_bound(model.config))
    with torch.no_grad():
        logprobs = torch.cat([reference_logprobs(model, sample) for sample in samples.values()])
    return float(-logprobs.sum() / logprobs.numel())


def test_settings_on_the_3b_module_tree(tmp_path):
    from flexrl_ds.bench.rollout_bench import SHAPES
    from flexrl_ds.models.loading import model_without_weights
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    result = run_bench_json("zero3-host", tmp_path / "result.json", "--work-dir", str(tmp_path), "--prompts", "2",
                            "--samples-per-prompt", "2", "--response-length", "16", "--repeats", "1",
                            "--settings", ",".join(SETTINGS))
    real = model_without_weights(str(make_tiny_model(TinyModelConfig(out_dir=str(tmp_path / "real"), **SHAPES["3b"]),
                                                     weights=False)))
    assert (result["modules"], result["parameters"]) == (len(list(real.modules())), len(list(real.parameters())))
    expected = _reference_loss(str(tmp_path / "tiny-3b"), str(tmp_path / "data" / "samples.jsonl"))
    assert result["bare_loss"] == pytest.approx(expected, rel=1e-5)
    rows = {row["setting"]: row for row in result["rows"]}
    assert list(rows) == list(SETTINGS)
    for name in ("shipped", "persist-all", "leaves-layers"):
        assert not rows[name]["error"] and rows[name]["loss"] == pytest.approx(expected, rel=1e-5), name
        assert rows[name]["seconds"] > 0
    hooks = {name: sum(rows[name]["calls"][k] for k in rows[name]["calls"] if k.endswith("_module_hook"))
             for name in ("shipped", "leaves-layers")}
    layers = real.config.text_config.num_hidden_layers + real.config.vision_config.depth
    assert rows["leaves-layers"]["leaves"] == layers and rows["shipped"]["leaves"] == 0
    assert hooks["leaves-layers"] * 10 < hooks["shipped"]
    assert rows["persist-all"]["persistent"] == result["parameters"] and rows["persist-all"]["calls"]["free_param"] == 0
    assert rows["shipped"]["calls"]["free_param"] >= result["parameters"]  # each released at least once a pass
    # DeepSpeed 0.19.8 cannot run this threshold's leaves (the whole vision tower among them); the bench says so
    granularity = rows["granularity-7m"]
    assert granularity["error"] or granularity["loss"] == pytest.approx(expected, rel=1e-5)
