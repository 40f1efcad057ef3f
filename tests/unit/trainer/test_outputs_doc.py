"""docs/OUTPUTS.md names every part of the per-step metrics the trainer's code defines (the end-to-end
run in tests/ray/test_train.py checks the keys of real rows against it too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexrl_ds.trainer.driver import INFERENCE_PARTS, PEAK_KEYS
from flexrl_ds.trainer.metrics import PHASES
from flexrl_ds.trainer.rollout_host import ROLLOUT_PARTS

DOC = (Path(__file__).resolve().parents[3] / "docs" / "OUTPUTS.md").read_text()


@pytest.mark.parametrize("name", sorted({*PEAK_KEYS, *PHASES, *ROLLOUT_PARTS, *INFERENCE_PARTS}))
def test_every_metric_part_is_documented(name):
    assert f"`{name}`" in DOC, f"docs/OUTPUTS.md does not explain `{name}`"
