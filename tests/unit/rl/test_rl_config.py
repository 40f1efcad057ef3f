"""`flexrl.rl` is a typed GRPOConfig: strict keys, checked values, errors naming the option."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexrl_ds.config.flexrl_config import load_run_config, parse_run_config
from flexrl_ds.rl.config import GRPOConfig

DS_CONFIGS = Path(__file__).resolve().parents[3] / "ds_configs"


def test_absent_section_gives_defaults():
    assert parse_run_config({"flexrl": {}}).flexrl.rl == GRPOConfig()
    assert parse_run_config({}).flexrl.rl.advantage_estimator == "group_norm"


@pytest.mark.parametrize("name", ["zero3_flexrl.json", "cpu_test.json"])
def test_shipped_configs_load_their_rl_section(name):
    raw = json.loads((DS_CONFIGS / name).read_text())["flexrl"].get("rl", {})
    rl = load_run_config(DS_CONFIGS / name).flexrl.rl
    assert isinstance(rl, GRPOConfig)
    for key, value in raw.items():
        assert getattr(rl, key) == value, key


def test_values_are_typed():
    rl = parse_run_config({"flexrl": {"rl": {"dual_clip": 3, "kl_clamp": None, "init_kl_coef": 0}}}).flexrl.rl
    assert rl.dual_clip == 3.0 and isinstance(rl.dual_clip, float) and rl.kl_clamp is None


@pytest.mark.parametrize(
    "section, match",
    [
        ({"advantage_estimatorr": "rloo"}, "flexrl.rl: unknown key"),
        ({"advantage_estimator": "gae"}, "flexrl.rl.advantage_estimator: 'gae' is not one of"),
        ({"kl_estimator": "k4"}, "flexrl.rl.kl_estimator: 'k4' is not one of"),
        ({"loss_reduction": "sum"}, "flexrl.rl.loss_reduction: 'sum' is not one of"),
        ({"eps_clip_low": 1.0}, r"flexrl.rl.eps_clip_low: must be in \[0, 1\)"),
        ({"eps_clip_high": -0.1}, "flexrl.rl.eps_clip_high: must be >= 0"),
        ({"dual_clip": 1.0}, "flexrl.rl.dual_clip: must be > 1"),
        ({"init_kl_coef": -0.01}, "flexrl.rl.init_kl_coef: must be >= 0"),
        ({"advantage_eps": 0}, "flexrl.rl.advantage_eps: must be positive"),
        ({"kl_clamp": 0}, "flexrl.rl.kl_clamp: must be positive"),
        ({"init_kl_coef": "0.1"}, "flexrl.rl.init_kl_coef: expected a number"),
    ],
)
def test_bad_values_name_the_option(section, match):
    with pytest.raises(ValueError, match=match):
        parse_run_config({"flexrl": {"rl": section}}, source="cfg.json")


def test_direct_construction_is_checked_too():
    with pytest.raises(ValueError, match="flexrl.rl.kl_estimator"):
        GRPOConfig(kl_estimator="k5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="flexrl.rl.init_kl_coef"):
        GRPOConfig(init_kl_coef=float("nan"))


@pytest.mark.parametrize("fields, message", [
    ({"policy_loss": "gspo"}, "set flexrl.rl.loss_reduction to sequence_mean"),
    ({"policy_loss": "grpo"}, "policy_loss: 'grpo' is not one of"),
    ({"tis_level": "seq"}, "tis_level: 'seq' is not one of"),
    ({"tis_cap": 0.0}, "tis_cap: must be positive"),
    ({"kl_target": 0.1, "init_kl_coef": 0.0}, "kl_target"),
    ({"ppo_epochs": 0}, "ppo_epochs: must be at least 1"),
    ({"dynamic_sampling_max_rounds": 0}, "dynamic_sampling_max_rounds"),
    ({"overlong_buffer_length": -1}, "overlong_buffer_length"),
    ({"reward_clip": -1.0}, "reward_clip: must be positive"),
    ({"loss_reduction": "seq-mean-token-sum"}, "loss_reduction: 'seq-mean-token-sum' is not one of"),
])
def test_new_keys_are_validated(fields, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**fields)
