"""The calibration files shipped in ds_configs/calibration/ load and drive the cost model."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexrl_ds.planning.cost_model import load_cost_model

FILES = sorted((Path(__file__).resolve().parents[3] / "ds_configs" / "calibration").glob("*.json"))


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_shipped_calibration_loads(path):
    formula, calibrated = load_cost_model("qwen2.5-vl-7b"), load_cost_model("qwen2.5-vl-7b", path)
    assert 0 < calibrated.c < formula.c  # measured attention is relatively costlier than FLOPs say
    assert calibrated.seconds(calibrated.cost(16384)) > 0
    assert calibrated.all_to_all_seconds(16384, 2) > 0


def test_some_file_is_shipped():
    assert FILES
