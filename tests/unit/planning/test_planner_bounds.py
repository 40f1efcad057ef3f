"""FlexUlysses against fixed SP at p_max, and the partition bounds of metrics.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from brute_force import best_split

from flexrl_ds.bench.workloads import MIXES, make_step, make_workload
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.baselines import fixed_sp, lpt_bucketing, verl_bucketing
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.planning.metrics import partition_bound
from flexrl_ds.planning.plan import SequenceSpec, Workload
from flexrl_ds.planning.planner import PlannerOptions, plan_step

COST = load_cost_model("qwen2.5-vl-7b")
OPTIONS = PlannerOptions()
SP = SPConfig(p_max=8)


def _assert_not_worse_than_fixed_sp(workload: Workload, world_size: int) -> None:
    flex = plan_step(workload, world_size, COST, SP).metrics
    sp8 = fixed_sp(workload, world_size, COST, min(8, world_size), 8).metrics
    assert flex.efficiency >= sp8.efficiency - 2 * OPTIONS.balance_tolerance
    # Attention balance is a diagnostic (both are charged by the executor's head split, under which
    # the planner may trade it for the busiest rank's cost), so it is not compared here.
    assert flex.all_to_all_volume <= sp8.all_to_all_volume + 1e-6
    assert flex.attention_balance >= flex.attention_balance_bound - 1e-9
    assert flex.efficiency <= flex.efficiency_bound + 1e-9


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(world_size=st.sampled_from([8, 16, 32, 64, 128]),
       lengths=st.lists(st.integers(OPTIONS.min_shard_tokens, 60_000), min_size=1, max_size=100))
# Found by Hypothesis in CI (2026-12-02): the planner's own block partition was 0.3 % worse than
# fixed SP's LPT one, and its refinement could not reach it without raising a block's attention.
@example(world_size=16, lengths=[1024, 1024, 1082, 2088, 5974, 1082, 1071, 2266, 11259])
def test_efficiency_at_least_fixed_sp_at_p_max_on_random_lengths(world_size, lengths):
    """No short sequences (those may stay whole where they dominate a block): within 0.2 %."""
    workload = Workload(tuple(SequenceSpec(id=f"s{i}", tokens=n) for i, n in enumerate(lengths)))
    _assert_not_worse_than_fixed_sp(workload, world_size)


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("world_size,gbs,n_samples", [(32, 64, 1), (64, 16, 8), (128, 64, 1), (16, 32, 2)])
def test_efficiency_at_least_fixed_sp_at_p_max_on_generated_steps(mix, world_size, gbs, n_samples):
    for seed in range(3):
        _assert_not_worse_than_fixed_sp(make_step(mix, gbs, n_samples, seed), world_size)


def test_paper_regime_beats_fixed_sp_on_attention_and_all_to_all():
    """32 ranks, image-heavy, 64 sequences: mean over seeds as `flexrl simulate` reports it."""
    flex, sp8 = [], []
    for seed in range(5):
        workload = make_step("image-heavy", 64, 1, seed)
        flex.append(plan_step(workload, 32, COST, SP).metrics)
        sp8.append(fixed_sp(workload, 32, COST, 8, 8).metrics)
    mean = lambda ms, key: float(np.mean([getattr(m, key) for m in ms]))  # noqa: E731
    assert mean(flex, "efficiency") >= mean(sp8, "efficiency") - OPTIONS.balance_tolerance
    assert mean(flex, "attention_balance") <= mean(sp8, "attention_balance")
    assert mean(flex, "all_to_all_relative") < 0.95


@settings(max_examples=150, deadline=None)
@given(values=st.lists(st.integers(1, 1000), min_size=1, max_size=7), bins=st.integers(1, 3))
def test_partition_bound_is_a_lower_bound_of_thebest_split(values, bins):
    bound = partition_bound(np.array(values, dtype=float), bins)
    assert max(values) <= bound <= best_split(values, bins) + 1e-9
    if len(values) == bins + 1 and bins > 1:
        assert bound >= sorted(values)[0] + sorted(values)[1]  # two of them must share a bin


def test_bounds_hold_for_every_method():
    workload = make_workload("video-heavy", 96, seed=4, n_samples=1)
    results = [plan_step(workload, 64, COST, SP).metrics, verl_bucketing(workload, 64, COST, 8).metrics,
               lpt_bucketing(workload, 64, COST, 8).metrics] + \
        [fixed_sp(workload, 64, COST, d, 8).metrics for d in (2, 4, 8)]
    for metrics in results:
        assert metrics.attention_balance >= metrics.attention_balance_bound - 1e-9
        assert metrics.efficiency <= metrics.efficiency_bound + 1e-9


@pytest.mark.parametrize("p_max", [4, 8, 16])
@pytest.mark.parametrize("tokens", [3_000, 30_000, 90_000])
def test_one_sequence_bound_is_the_best_fixed_degree(tokens, p_max):
    """One sequence alone: the best plan is fixed SP at one degree d ≤ p_max, so the efficiency bound
    is the best of those plans, under the executor's head split (28 heads: at d = 8 some rank holds
    4/28 of the attention, not 1/8) — neither lower (a bound no plan reaches) nor higher."""
    workload = Workload((SequenceSpec(id="long", tokens=tokens),))
    sp = SPConfig(p_max=p_max)
    degrees = [d for d in (1, 2, 4, 8, 16) if d <= p_max]
    best = min(fixed_sp(workload, 32, COST, d, p_max).metrics.max_rank_cost for d in degrees)
    metrics = plan_step(workload, 32, COST, sp).metrics
    assert metrics.efficiency_bound == pytest.approx(metrics.lower_bound / best, rel=1e-9)
    assert metrics.efficiency <= metrics.efficiency_bound + 1e-9
    # below 1 exactly where p_max does not divide the query heads (28: at p_max 8 and 16)
    assert (metrics.efficiency_bound < 1 - 1e-9) == (COST.num_heads % p_max != 0)


def test_video_heavy_64_on_128_ranks_seed_2_cannot_reach_097():
    """The one grid cell under 0.97: 40 long videos on 16 aligned 8-rank blocks — some block holds
    3 of the 33 longest, so no plan reaches 0.97 (even with every block's heads split evenly). Under the
    executor's split (28 heads: 4 or 3 per rank at degree 8) the planner reaches 0.898 against
    fixed SP=8's 0.829; a wider cap (p ≤ 16: 2 heads or 1 per rank, the 1-head ranks taking more
    short work) gets 0.95."""
    workload = make_workload("video-heavy", 64, seed=2)
    metrics = plan_step(workload, 128, COST, SP).metrics
    assert metrics.efficiency_bound < 0.97
    assert metrics.efficiency >= fixed_sp(workload, 128, COST, 8, 8).metrics.efficiency + 0.05
    assert plan_step(workload, 128, COST, SPConfig(p_max=16)).metrics.efficiency >= 0.95
