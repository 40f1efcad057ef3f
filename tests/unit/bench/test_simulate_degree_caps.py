"""`flexrl simulate`'s extra FlexUlysses rows with wider degree caps (the paper's 32-rank setting)."""

from __future__ import annotations

import json

import pytest

from flexrl_ds.bench.simulator import default_extra_p_maxes
from flexrl_ds.cli.main import main
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import load_cost_model

COST_7B = load_cost_model("qwen2.5-vl-7b")


def test_default_extra_cap_is_the_widest_the_world_and_heads_allow():
    assert default_extra_p_maxes(32, SPConfig(p_max=8), COST_7B) == (16,)  # 28 query heads
    assert default_extra_p_maxes(8, SPConfig(p_max=8), COST_7B) == ()
    assert default_extra_p_maxes(64, SPConfig(p_max=32), load_cost_model("qwen2.5-vl-32b")) == ()  # 40 heads


def test_wider_cap_row_reaches_its_own_bound(capsys):
    assert main(["simulate", "--mix", "image-heavy", "--world-size", "32", "--gbs", "64", "--n-samples", "1",
                 "--seeds", "2", "--json"]) == 0
    methods = json.loads(capsys.readouterr().out)["methods"]
    narrow, wide = methods["FlexUlysses"], methods["FlexUlysses p<=16"]
    assert wide["attention_balance"] <= narrow["attention_balance"] + 1e-9
    assert wide["attention_balance_bound"] <= narrow["attention_balance_bound"] + 1e-9
    for row in (narrow, wide):
        assert row["attention_balance"] >= row["attention_balance_bound"] - 1e-9
        assert row["efficiency"] >= 0.97


def test_extra_cap_option(capsys):
    args = ["simulate", "--mix", "only-video", "--world-size", "8", "--gbs", "4", "--seeds", "1", "--json"]
    assert main(args + ["--p-max", "4", "--extra-p-max", "none"]) == 0
    assert list(json.loads(capsys.readouterr().out)["methods"]).count("FlexUlysses p<=8") == 0
    assert main(args + ["--p-max", "4", "--extra-p-max", "8,2"]) == 0
    methods = json.loads(capsys.readouterr().out)["methods"]
    assert {"FlexUlysses p<=8", "FlexUlysses p<=2"} <= set(methods)
    assert main(args + ["--extra-p-max", "3"]) == 2
    assert "--extra-p-max: 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(args + ["--extra-p-max"])
