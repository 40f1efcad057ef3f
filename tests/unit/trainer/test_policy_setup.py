"""launch.policy_setup: the run config's trainer settings reach every policy rank's PolicySetup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexrl_ds.config.flexrl_config import parse_run_config
from flexrl_ds.trainer.launch import policy_setup

CONFIG = Path(__file__).resolve().parents[3] / "ds_configs" / "grpo_tiny_cpu.json"


@pytest.mark.parametrize("checkpointing", [None, False, True])
def test_activation_checkpointing_reaches_the_policy_setup(checkpointing):
    raw = json.loads(CONFIG.read_text())
    if checkpointing is not None:
        raw["flexrl"]["trainer"]["activation_checkpointing"] = checkpointing
    setup = policy_setup(parse_run_config(raw), "model-dir", pixels=None, colocated=True)
    assert setup.activation_checkpointing is bool(checkpointing)
