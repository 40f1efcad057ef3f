"""GRPO advantages against plain-Python loops over groups (statistics module for mean/stdev)."""

from __future__ import annotations

import statistics
import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexrl_ds.rl.advantages import ESTIMATORS, group_advantages, grouped_rewards, token_advantages
from flexrl_ds.rl.config import ADVANTAGE_ESTIMATORS, GRPOConfig

EPS = 1e-9


def reference_advantages(rewards: list[float], n: int, estimator: str) -> list[float]:
    out = []
    for start in range(0, len(rewards), n):
        group = rewards[start:start + n]
        if len(set(group)) == 1:
            out.extend([0.0] * n)
            continue
        mean = statistics.fmean(group)
        for k, reward in enumerate(group):
            if estimator == "group_norm":
                out.append((reward - mean) / (statistics.stdev(group) + EPS))
            elif estimator == "dr_grpo":
                out.append(reward - mean)
            else:
                others = group[:k] + group[k + 1:]
                out.append(reward - sum(others) / len(others))
    return out


@settings(max_examples=60, deadline=None)
@given(
    num_prompts=st.integers(1, 6),
    n=st.integers(2, 8),
    estimator=st.sampled_from(["group_norm", "dr_grpo", "rloo"]),
    data=st.data(),
)
def test_matches_loop_reference(num_prompts, n, estimator, data):
    values = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(-5, 5, allow_nan=False))
    rewards = data.draw(st.lists(values, min_size=num_prompts * n, max_size=num_prompts * n))
    flat = group_advantages(torch.tensor(rewards, dtype=torch.float64), n, estimator, EPS)
    expected = torch.tensor(reference_advantages(rewards, n, estimator), dtype=torch.float64)
    assert flat.shape == (num_prompts * n,)
    torch.testing.assert_close(flat, expected, rtol=1e-6, atol=1e-6)
    grid = group_advantages(torch.tensor(rewards, dtype=torch.float64).reshape(num_prompts, n), n, estimator, EPS)
    assert grid.shape == (num_prompts, n)
    torch.testing.assert_close(grid.reshape(-1), flat)


@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo", "rloo"])
@pytest.mark.parametrize("value", [0.1, 0.3, 0.7, 1.0, -2.5])
def test_equal_rewards_give_exactly_zero_in_float32(estimator, value):
    # 0.1 x 7 in float32: r - mean is one ulp, std one ulp; unguarded group_norm gives ~0.8 here.
    rewards = torch.full((3 * 7,), value, dtype=torch.float32)
    assert torch.equal(group_advantages(rewards, 7, estimator), torch.zeros_like(rewards))


def test_mixed_groups_one_constant():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    advantages = group_advantages(rewards, 4)
    assert torch.equal(advantages[4:], torch.zeros(4))
    assert advantages[0] > 0 and (advantages[1:4] < 0).all()
    assert abs(float(advantages[:4].sum())) < 1e-6  # group_norm advantages sum to 0 per group


def test_group_norm_scale_invariance_and_binary_values():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    advantages = group_advantages(rewards, 4)
    # mean 0.5, sample std sqrt(1/3): +-0.5 / 0.57735 = +-0.866
    torch.testing.assert_close(advantages, torch.tensor([1, -1, 1, -1], dtype=torch.float64) * 0.5 / (1 / 3) ** 0.5)
    torch.testing.assert_close(group_advantages(rewards * 10 + 3, 4), advantages)


@pytest.mark.parametrize(
    "rewards, n, match",
    [
        (torch.tensor([1.0, 2.0, 3.0]), 2, r"shape \(3,\) is neither"),
        (torch.ones(2, 3), 2, r"shape \(2, 3\) is not \(num_prompts, 2\)"),
        (torch.ones(2, 2, 2), 2, "is neither"),
        (torch.tensor([1.0, float("nan"), 0.0, 1.0]), 2, r"sample 1 \(prompt 0, k=1\) has non-finite reward nan"),
        (torch.tensor([1.0, 0.0, 0.0, float("inf"), float("-inf"), 0.0]), 3,
         r"sample 3 \(prompt 1, k=0\) has non-finite reward inf; 2 sample"),
        (torch.tensor([1, 0, 1, 0]), 2, "floating-point"),
        (torch.tensor([1.0, 0.0]), 0, "num_samples_per_prompt"),
        (torch.tensor([]), 2, "empty"),
    ],
)
def test_invalid_rewards_are_rejected(rewards, n, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, n)


@pytest.mark.parametrize("estimator", ["group_norm", "rloo"])
def test_std_and_leave_one_out_need_two_samples(estimator):
    with pytest.raises(ValueError, match=f"estimator '{estimator}' needs num_samples_per_prompt >= 2"):
        group_advantages(torch.tensor([1.0, 0.0]), 1, estimator)
    assert torch.equal(group_advantages(torch.tensor([1.0, 0.0]), 1, "dr_grpo"), torch.zeros(2))
    with pytest.raises(ValueError, match="estimator: 'gae' is not one of"):
        group_advantages(torch.tensor([1.0, 0.0]), 2, "gae")


def test_the_config_accepts_exactly_the_registered_estimators():
    # rl/config.py is torch-free, so it keeps the names; they must be the registry's, in its order
    assert ADVANTAGE_ESTIMATORS == tuple(ESTIMATORS)
    assert typing.get_args(typing.get_type_hints(GRPOConfig)["advantage_estimator"]) == tuple(ESTIMATORS)
    for name in ESTIMATORS:
        assert GRPOConfig(advantage_estimator=name).advantage_estimator == name


@settings(max_examples=30, deadline=None)
@given(num_samples=st.integers(1, 6), length=st.integers(1, 9), data=st.data())
def test_token_advantages_follow_the_mask(num_samples, length, data):
    bits = data.draw(st.lists(st.booleans(), min_size=num_samples * length, max_size=num_samples * length))
    mask = torch.tensor(bits).reshape(num_samples, length)
    advantages = torch.randn(num_samples, dtype=torch.float64)
    tokens = token_advantages(advantages, mask)
    for s in range(num_samples):
        for t in range(length):
            assert tokens[s, t].item() == (advantages[s].item() if bits[s * length + t] else 0.0)


def test_token_advantages_shape_errors():
    with pytest.raises(ValueError, match=r"response_mask: shape \(3, 4\) is not \(2, L\)"):
        token_advantages(torch.zeros(2), torch.ones(3, 4))
    with pytest.raises(ValueError, match="advantages: expected shape"):
        token_advantages(torch.zeros(2, 1), torch.ones(2, 4))


def test_grouped_rewards_is_prompt_major():
    rewards = torch.arange(6, dtype=torch.float32)
    assert grouped_rewards(rewards, 3).tolist() == [[0, 1, 2], [3, 4, 5]]
