"""reinforce_baseline, no_std_norm, reward/advantage clips, KL-in-reward advantages, the overlong
penalty and the adaptive KL controller, against plain Python loops and hand computations."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from flexrl_ds.rl.advantages import group_advantages, kl_reward_advantages
from flexrl_ds.rl.shaping import AdaptiveKLController, overlong_penalty

REWARDS = [1.0, 0.0, 0.5, 0.5, 3.0, 3.0, 3.0, 3.0, 0.0, 2.0, 2.0, 1.0]  # 3 groups of 4, the middle one equal
N = 4


def loop_centred(rewards):
    out = []
    for p in range(0, len(rewards), N):
        group = rewards[p:p + N]
        mean = sum(group) / N
        out += [0.0 if max(group) == min(group) else r - mean for r in group]
    return out


def test_reinforce_baseline_whitens_the_centred_rewards_over_the_step():
    centred = loop_centred(REWARDS)
    mean, std = statistics.fmean(centred), statistics.stdev(centred)
    constant = [max(REWARDS[p // N * N:p // N * N + N]) == min(REWARDS[p // N * N:p // N * N + N]) for p in range(12)]
    expected = [0.0 if c else (a - mean) / (std + 1e-9) for a, c in zip(centred, constant)]
    got = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), N, "reinforce_baseline")
    assert got.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    centred_only = group_advantages(torch.tensor(REWARDS, dtype=torch.float64), N, "reinforce_baseline", std_norm=False)
    assert centred_only.tolist() == pytest.approx([0.0 if c else a - mean for a, c in zip(centred, constant)], abs=1e-12)


def test_no_std_norm_makes_group_norm_dr_grpo():
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    got = group_advantages(rewards, N, "group_norm", std_norm=False)
    assert got.tolist() == pytest.approx(loop_centred(REWARDS), abs=1e-12)
    assert torch.equal(got, group_advantages(rewards, N, "dr_grpo"))


def test_reward_and_advantage_clips():
    rewards = [12.0, -30.0, 0.0, 1.0]
    clipped = [min(max(r, -10.0), 10.0) for r in rewards]
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), N, "dr_grpo", reward_clip=10.0)
    assert got.tolist() == pytest.approx(loop_centred(clipped))
    got = group_advantages(torch.tensor(rewards, dtype=torch.float64), N, "dr_grpo", advantage_clip=5.0)
    assert got.tolist() == pytest.approx([min(max(a, -5.0), 5.0) for a in loop_centred(rewards)])


def test_kl_in_reward_advantage_is_the_return_of_the_kl_rewards():
    kl = [0.2, -0.1, 0.4, 0.0]
    got = kl_reward_advantages(0.7, kl, kl_coef=0.5)
    for t in range(len(kl)):
        assert got[t] == pytest.approx(0.7 + sum(-0.5 * k for k in kl[t:]))
    assert kl_reward_advantages(0.3, [], 0.5) == []


def test_overlong_penalty_formula():
    # L_max 16, buffer 4: free up to 12 tokens, then -1/4 per token down to -factor at 16
    assert [overlong_penalty(n, 16, 4, 2.0) for n in (1, 12, 13, 14, 16)] == [0.0, 0.0, -0.5, -1.0, -2.0]
    assert overlong_penalty(16, 16, 0, 2.0) == 0.0
    with pytest.raises(ValueError, match="overlong_buffer_length"):
        overlong_penalty(3, 16, 17, 1.0)


def test_adaptive_kl_controller_by_hand():
    control = AdaptiveKLController(coef=0.1, target=0.05, horizon=100)
    assert control.update(0.06, 10) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))   # error 0.2
    assert control.update(1.0, 10) == pytest.approx(0.1 * 1.02 * 1.02)            # clipped at +0.2
    assert control.update(0.04, 50) == pytest.approx(0.1 * 1.02 * 1.02 * (1 - 0.2 * 0.5))
    assert math.isfinite(control.coef)
