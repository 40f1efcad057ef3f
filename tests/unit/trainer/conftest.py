"""A tiny random Qwen2.5-VL, a small dataset and the shipped tiny config, built once per session."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
TINY_CONFIG = REPO / "ds_configs" / "grpo_tiny_cpu.json"


@pytest.fixture(scope="session")
def trainer_assets(tmp_path_factory):
    from flexrl_ds.models.sample_data import write_scoring_dataset
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("trainer_assets")
    model = make_tiny_model(TinyModelConfig(out_dir=str(root / "vl"), seed=11))
    data = write_scoring_dataset(root / "data", num_records=4, seed=4, with_video=False)
    return {"model": str(model), "data": str(data)}


@pytest.fixture
def raw_config():
    """The shipped tiny GRPO config as a dict (a fresh copy per test, to edit)."""
    return copy.deepcopy(json.loads(TINY_CONFIG.read_text()))
