"""trainer/rl_step.py: dynamic sampling rounds, mini-batch order, the old-pass skip rule, the resolved
settings and schedule, the driver's per-token inputs, the KL coefficient's save and load."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest

from flexrl_ds.rl.config import GRPOConfig
from flexrl_ds.trainer.rl_step import (DynamicSampling, KLCoefficient, equal_reward_groups, mini_batch_prompts,
                                       resolved_rl, skips_old_pass, token_shaping)


def prompt(name: str, n: int = 2):
    return SimpleNamespace(name=name, sample_names=[f"{name}k{k}" for k in range(n)])


def test_dynamic_sampling_rolls_out_the_deficit_until_full():
    pool = [prompt(f"p{i}") for i in range(8)]
    equal = {"p0", "p2", "p3"}
    asked = []

    def roll(batch):
        asked.append([p.name for p in batch])
        return batch, {p.name for p in batch} & equal

    sampling = DynamicSampling(target=3, max_rounds=5)
    kept = sampling.run(pool, roll)
    assert asked == [["p0", "p1", "p2"], ["p3", "p4"], ["p5"]]
    assert [p.name for p in kept] == ["p1", "p4", "p5"]
    assert sampling.metrics() == {"rounds": 3.0, "groups_rolled_out": 6.0, "groups_dropped": 3.0,
                                  "groups_kept": 3.0, "dropped_frac": 0.5}


def test_dynamic_sampling_stops_at_its_rounds_and_keeps_the_first_round_when_all_equal():
    pool = [prompt(f"p{i}") for i in range(8)]
    sampling = DynamicSampling(target=2, max_rounds=2)
    kept = sampling.run(pool, lambda batch: (batch, {p.name for p in batch}))
    assert [p.name for p in kept] == ["p0", "p1"] and sampling.rounds == 2 and sampling.dropped == 4


def test_equal_reward_groups():
    rewards = {"ak0": 1.0, "ak1": 1.0, "bk0": 0.0, "bk1": 1.0}
    assert equal_reward_groups([prompt("a"), prompt("b")], rewards) == {"a"}


def test_mini_batch_order_depends_on_seed_step_and_epoch_only():
    prompts = [prompt(f"p{i}") for i in range(12)]
    first = mini_batch_prompts(prompts, seed=3, step=5, epoch=0, shuffle=True)
    assert [p.name for p in first] == [p.name for p in mini_batch_prompts(list(prompts), 3, 5, 0, True)]
    assert sorted(p.name for p in first) == sorted(p.name for p in prompts) and first != prompts
    assert mini_batch_prompts(prompts, 3, 5, 1, True) != first
    assert mini_batch_prompts(prompts, 3, 5, 0, False) == prompts


def test_the_old_pass_is_skipped_only_where_nothing_needs_it_first():
    rl = GRPOConfig()
    assert skips_old_pass(rl, 1)
    assert not skips_old_pass(rl, 2)
    for change in ({"ppo_epochs": 2}, {"tis_level": "token"}, {"kl_in_reward": True}, {"kl_target": 0.1},
                   {"old_logprob_pass": "always"}):
        assert not skips_old_pass(dataclasses.replace(rl, **change), 1), change


def flexrl(rl: GRPOConfig, global_batch: int = 8, max_length: int = 16):
    return SimpleNamespace(rl=rl, rollout=SimpleNamespace(max_response_length=max_length),
                           data=SimpleNamespace(loader=SimpleNamespace(global_batch=global_batch)))


def test_resolved_settings():
    rl = resolved_rl(flexrl(GRPOConfig()))
    assert (rl.loss_norm_length, rl.dynamic_sampling_prompts) == (16, 4)
    with pytest.raises(ValueError, match="overlong_buffer_length: 20 is more than"):
        resolved_rl(flexrl(GRPOConfig(overlong_buffer_length=20)))
    with pytest.raises(ValueError, match="dynamic_sampling_prompts: 9 groups"):
        resolved_rl(flexrl(GRPOConfig(dynamic_sampling=True, dynamic_sampling_prompts=9)))
    with pytest.raises(ValueError, match="mini_batches_per_step: 3 for the 2 prompts"):
        resolved_rl(flexrl(GRPOConfig(dynamic_sampling=True, dynamic_sampling_prompts=2, mini_batches_per_step=3)))


def test_auto_total_steps_of_the_schedule():
    from flexrl_ds.models.zero3 import with_schedule_length as resolved_schedule

    config = {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 2}}}
    assert resolved_schedule(config, 12)["scheduler"]["params"] == {"total_num_steps": 12, "warmup_num_steps": 2}
    assert config["scheduler"]["params"]["total_num_steps"] == "auto"
    assert resolved_schedule({"optimizer": {}}, 12) == {"optimizer": {}}


def test_token_shaping_by_hand():
    names = ["a", "b"]
    old = {"a": [-1.0, -2.0], "b": [-0.5]}
    ref = {"a": [-1.5, -1.0], "b": [-0.5]}
    engine = {"a": [-1.2, -2.0], "b": [-0.1]}
    rl = GRPOConfig(kl_in_reward=True, tis_level="token", tis_cap=1.1)
    shaped = token_shaping(names, {"a": 1.0, "b": -1.0}, old, ref, engine, rl, kl_coef=0.1)
    # k1: a = [0.5, -1.0], b = [0.0]
    assert shaped.advantages["a"] == pytest.approx([1.0 - 0.1 * (0.5 - 1.0), 1.0 + 0.1])
    assert shaped.advantages["b"] == pytest.approx([-1.0])
    assert shaped.is_weights["a"] == pytest.approx([1.1, 1.0]) and shaped.is_weights["b"] == pytest.approx([math.exp(-0.4)])
    assert shaped.metrics["kl_k1"] == pytest.approx(-0.5 / 3)
    assert shaped.metrics["kl_reward_mean"] == pytest.approx((0.05 + 0.0) / 2)
    assert shaped.metrics["tis_clipped_frac"] == pytest.approx(1 / 3)
    plain = token_shaping(names, {"a": 1.0, "b": -1.0}, {}, ref, engine, GRPOConfig(), kl_coef=0.1)
    assert plain.advantages == {"a": 1.0, "b": -1.0} and plain.is_weights == {} and plain.metrics == {}


def test_the_adaptive_kl_coefficient_survives_a_checkpoint(tmp_path):
    rl = GRPOConfig(init_kl_coef=0.1, kl_target=0.05, kl_horizon=100)
    coefficient = KLCoefficient(rl)
    coefficient.update(0.06, 10)
    coefficient.save(tmp_path)
    resumed = KLCoefficient(rl)
    resumed.load(tmp_path)
    assert resumed.value == coefficient.value == pytest.approx(0.1 * 1.02)
    fixed = KLCoefficient(GRPOConfig(init_kl_coef=0.3))
    fixed.update(1.0, 10)
    assert fixed.value == 0.3
