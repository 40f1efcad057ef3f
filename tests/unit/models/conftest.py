"""Tiny models and a small media dataset, built once per test session (no hub, no downloads)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    from flexrl_ds.models.sample_data import write_scoring_dataset
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("tiny_models")
    vl = make_tiny_model(TinyModelConfig(out_dir=str(root / "vl"), seed=11))
    q2 = make_tiny_model(TinyModelConfig(out_dir=str(root / "q2"), arch="qwen2", seed=11))
    data = write_scoring_dataset(root / "data", num_records=8, seed=4)
    return {"vl": str(vl), "q2": str(q2), "data": str(data)}


@pytest.fixture(scope="session")
def vl_samples(tiny_assets):
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.tools.logprobs import encode_dataset

    model = load_model(tiny_assets["vl"])
    return model, encode_dataset(tiny_assets["vl"], tiny_assets["data"])
