"""The attention-first search bounded by counted work (attention_search.WORK_BUDGET) at any step
size, and the joint attention/cost certificate (metrics.attention_cost_infeasible) that tells the
planner where no partition can meet both goals (docs/BENCHMARKS.md "Planner")."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flexrl_ds.planning.attention_search as attention_search
from flexrl_ds.bench.planner_bench import format_quality, measure_quality
from flexrl_ds.bench.workloads import make_workload
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.attention_search import WORK_BUDGET, WorkMeter, counted_start, search_partition
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.planning.metrics import attention_cost_infeasible
from flexrl_ds.planning.plan import SequenceSpec, Workload, validate_plan
from flexrl_ds.planning.planner import PlannerOptions, plan_step
from flexrl_ds.planning.schedule import check_schedule

COST = load_cost_model("qwen2.5-vl-7b")
SP = SPConfig(p_max=8)


def _values(mix: str, num: int, seed: int) -> np.ndarray:
    tokens = np.array([s.tokens for s in make_workload(mix, num, seed).sequences], dtype=float)
    return np.stack([tokens * tokens + COST.c * tokens, tokens * tokens, tokens])


def _best_split_exists(cost, attention, bins, attention_cap, cost_cap) -> bool:
    """Brute force over every assignment of the items to the bins."""
    assignments = np.array(list(itertools.product(range(bins), repeat=len(cost))))
    one_hot = assignments[:, :, None] == np.arange(bins)[None, None, :]
    ok = ((one_hot * np.asarray(attention)[None, :, None]).sum(axis=1) <= attention_cap).all(axis=1)
    ok &= ((one_hot * np.asarray(cost)[None, :, None]).sum(axis=1) <= cost_cap).all(axis=1)
    return bool(ok.any())


@settings(max_examples=300, deadline=None)
@given(items=st.lists(st.tuples(st.integers(1, 100), st.integers(1, 100)), min_size=1, max_size=7),
       bins=st.integers(1, 3), attention_slack=st.floats(1.0, 1.6), cost_slack=st.floats(1.0, 1.6))
def test_certificate_never_claims_a_split_that_exists_is_impossible(items, bins, attention_slack, cost_slack):
    cost, attention = (np.array(column, dtype=float) for column in zip(*items))
    attention_cap = attention.sum() / bins * attention_slack
    cost_cap = cost.sum() / bins * cost_slack
    if attention_cost_infeasible(cost, attention, bins, attention_cap, cost_cap):
        assert not _best_split_exists(cost, attention, bins, attention_cap, cost_cap)


def test_certificate_sees_the_cost_the_long_items_bins_still_need():
    """Lengths 5, 3, 3, 2, 2, 1 (cost L² + 4L, attention L²) on two bins, attention cap 26 (the mean),
    cost cap 60: the 25-attention item's bin can add only the 1-attention item (cost 45 + 5), so the
    other bin holds cost 66 — though each cap alone can be met."""
    lengths = np.array([5, 3, 3, 2, 2, 1], dtype=float)
    attention, cost = lengths ** 2, lengths ** 2 + 4 * lengths
    assert attention_cost_infeasible(cost, attention, 2, 26, 60)
    assert not _best_split_exists(cost, attention, 2, 26, 60)
    assert _best_split_exists(cost, attention, 2, 26, 1e9) and _best_split_exists(cost, attention, 2, 1e9, 60)
    assert not attention_cost_infeasible(cost, attention, 2, 26, 66)


@pytest.mark.parametrize("mix,seed,cost_reachable", [("image-heavy", 7, 1.2), ("only-video", 17, 1.07)])
def test_two_stragglers_cannot_reach_both_goals(mix, seed, cost_reachable):
    """image-heavy 128 × 128 ranks seed 7 (8 videos of ~0.95 × a mean block's attention) and
    only-video seed 17 (40 videos of ~0.35: 8 blocks hold three) cannot have attention ≤ 1.05 with
    cost balance ≤ 1.03 on 8-rank blocks; the planner keeps cost balance and efficiency there."""
    values = _values(mix, 128, seed)
    means = values.sum(axis=1) / 16
    assert attention_cost_infeasible(values[0], values[1], 16, 1.05 * means[1], 1.03 * means[0])
    assert not attention_cost_infeasible(values[0], values[1], 16, 1.05 * means[1], cost_reachable * means[0])
    metrics = plan_step(make_workload(mix, 128, seed), 128, COST, SP).metrics
    assert metrics.attention_balance_bound < 1.05 < metrics.attention_balance
    assert metrics.cost_balance <= 1.03 and metrics.efficiency >= 0.97


@pytest.mark.parametrize("num,seed", [(128, 18), (512, 16)])
def test_image_heavy_on_128_ranks_reaches_the_attention_target(num, seed):
    """The search now runs at any step size (bounded by work): 128 sequences seed 18, 1.054 ->
    ≤ 1.05; 512 sequences seed 16 (56 long videos, 8 blocks hold four: the counted start),
    1.053 -> ≤ 1.05."""
    workload = make_workload("image-heavy", num, seed)
    metrics = plan_step(workload, 128, COST, SP).metrics
    assert metrics.attention_balance <= 1.05
    assert metrics.cost_balance <= 1.03 and metrics.efficiency >= 0.97
    off = plan_step(workload, 128, COST, SP, PlannerOptions(attention_search_cost_cap=0)).metrics
    assert off.attention_balance > 1.05


def test_counted_start_gives_the_lightest_long_videos_to_the_blocks_that_hold_four():
    """image-heavy 512 sequences, seed 16, 16 blocks: 56 videos above 10 % of a mean block's
    attention, at most 4 per block under the goal, so 8 blocks hold four — the 32 lightest."""
    values = _values("image-heavy", 512, 16)
    means = values.sum(axis=1) / 16
    blocks = counted_start(values, 16, float("inf"), 1.05 / 1.001 * means[1])
    heavy = np.argsort(-values[1], kind="stable")[:56]
    assert (values[1, heavy] > 0.1 * means[1]).all() and values[1, np.argsort(-values[1])[56]] <= 0.1 * means[1]
    per_block = np.bincount(blocks[heavy], minlength=16)
    assert sorted(per_block.tolist()) == [3] * 8 + [4] * 8
    in_fours = per_block[blocks[heavy]] == 4
    assert values[1, heavy[in_fours]].max() <= values[1, heavy[~in_fours]].min()
    assert (blocks >= 0).all()


@pytest.fixture
def scored(monkeypatch):
    """Counts the candidates the descent scores (entries of its gain tables), independently of the
    search's own meter."""
    count = {"entries": 0}
    move, exchange = attention_search._best_move, attention_search._best_exchange

    def counted_move(blocks, scaled, sums, current, givers):
        count["entries"] += len(givers) * len(current)
        return move(blocks, scaled, sums, current, givers)

    def counted_exchange(blocks, scaled, sums, current, givers, takers, second_takers):
        count["entries"] += len(givers) * len(takers)
        return exchange(blocks, scaled, sums, current, givers, takers, second_takers)

    monkeypatch.setattr(attention_search, "_best_move", counted_move)
    monkeypatch.setattr(attention_search, "_best_exchange", counted_exchange)
    return count


@pytest.mark.parametrize("mix,num", [("image-heavy", 128), ("only-video", 512)])
def test_a_failing_search_stays_within_its_work_budget(scored, mix, num):
    """Goal = the mean (unreachable): the search fails having scored ≤ WORK_BUDGET candidates (it
    took 0.8–8 s without the budget on these steps)."""
    values = _values(mix, num, 7)
    means = values.sum(axis=1) / 16
    meter = WorkMeter()
    assert search_partition(values, 16, float("inf"), means[1], means[0], 1.03 * means[0], meter) is None
    assert 0 < scored["entries"] <= meter.used <= WORK_BUDGET
    unlimited = WorkMeter(limit=10 * WORK_BUDGET)
    search_partition(values, 16, float("inf"), means[1], means[0], 1.03 * means[0], unlimited)
    assert unlimited.used > WORK_BUDGET  # the budget is what stopped it


def test_plans_are_a_pure_function_of_the_inputs():
    workload = make_workload("image-heavy", 128, 18)
    first, second = (plan_step(workload, 128, COST, SP).plan for _ in range(2))
    assert first == second


@st.composite
def long_steps(draw):
    """65–260 sequences: some long videos (15k–40k tokens) among short ones (the search runs on
    about a quarter of these with a target of 1.0–1.05)."""
    num = draw(st.integers(65, 260))
    num_long = draw(st.integers(1, num // 3))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    lengths = np.concatenate([rng.integers(15_000, 40_000, num_long), rng.integers(100, 4_000, num - num_long)])
    workload = Workload(tuple(SequenceSpec(id=f"q{i}", tokens=int(n)) for i, n in enumerate(lengths)))
    return workload, draw(st.sampled_from([32, 64, 128])), draw(st.floats(1.0, 1.05))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(long_steps())
def test_plans_with_the_search_forced_on_at_any_size_are_valid(case):
    """A low attention target makes the repair and the search run on steps above 64 sequences."""
    workload, world_size, target = case
    result = plan_step(workload, world_size, COST, SP, PlannerOptions(attention_target=target))
    validate_plan(result.plan, workload)
    assert check_schedule(result.plan).deadlock_free
    assert result.metrics.attention_balance >= result.metrics.attention_balance_bound - 1e-9


def test_bench_counts_misses_where_the_targets_conflict_apart():
    """20 seeds of only-video 128 × 128: seeds 15 and 17 stay above 1.05 with the attention bound
    below it, and neither can also have cost balance ≤ 1.03 (marked '~', not '#')."""
    rows = measure_quality(COST, SP, 20, counts=(128,), world_sizes=(128,), mixes=("only-video",))
    assert rows[0]["attention_misses"] == rows[0]["attention_misses_joint"] == 2
    assert format_quality(rows).splitlines()[-1].endswith("~")
