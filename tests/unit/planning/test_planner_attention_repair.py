"""Attention repair of the p-block partition (attention_repair.py): one-for-many exchanges under a
bounded cost slack."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexrl_ds.bench.workloads import make_workload
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.attention_repair import repair_attention
from flexrl_ds.planning.baselines import fixed_sp
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.planning.placement import _exchange_pairs, _improve
from flexrl_ds.planning.plan import SequenceSpec, Workload, validate_plan
from flexrl_ds.planning.planner import PlannerOptions, plan_step
from flexrl_ds.planning.schedule import check_schedule

COST = load_cost_model("qwen2.5-vl-7b")
REPAIR_OFF = PlannerOptions(attention_target=float("inf"))


def _values(tokens) -> np.ndarray:
    tokens = np.asarray(tokens, dtype=float)
    return np.stack([tokens * tokens + COST.c * tokens, tokens * tokens, tokens])


def _sums(values: np.ndarray, blocks: np.ndarray, num_blocks: int) -> np.ndarray:
    return np.stack([np.bincount(blocks, weights=row, minlength=num_blocks) for row in values])


def _length_of_cost(cost: float) -> int:
    """The integer length whose cost L² + c·L is nearest to `cost`."""
    return int(round((-COST.c + np.sqrt(COST.c ** 2 + 4 * cost)) / 2))


def test_one_for_four_exchange_evens_attention_where_pair_exchanges_cannot():
    """Block 0: [5000, 2000, 2000]; block 1: [5000, 8 shorts of a quarter of a 2000's cost each]:
    equal cost, block 0 has more attention. Any move, swap or 2-for-1 swap changes a block's cost
    by at least half a 2000's cost (far over a 0.1 % slack); giving one 2000 for four shorts keeps
    cost and makes both blocks equal."""
    short = _length_of_cost(_values([2000])[0, 0] / 4)
    values = _values([5000, 2000, 2000, 5000] + [short] * 8)
    blocks = np.array([0, 0, 0] + [1] * 9)
    before = _sums(values, blocks, 2)
    ceilings = np.array([before[0].max() * 1.001, np.inf, np.inf])
    for refine in (lambda b: _improve(b, values, 1, ceilings, 8, 2, before[1].mean()),
                   lambda b: _exchange_pairs(values, b, 2, ceilings, 8, before[1].mean())):
        tried = blocks.copy()
        refine(tried)
        assert (tried == blocks).all()

    made = repair_attention(values, blocks, 2, np.inf, 0.001, before[1].mean() * (1 + 1e-6), 8)
    after = _sums(values, blocks, 2)
    assert made == 1
    assert after[0].max() <= ceilings[0]
    assert after[1].max() <= before[1].mean() * (1 + 1e-6)
    assert sorted(np.bincount(blocks, minlength=2).tolist()) == [6, 6]


def test_image_heavy_256_on_128_ranks_reaches_the_attention_target():
    """The grid cell whose attention stayed at 1.061 (seed 1; attention-only bound 1.022): with the
    repair every seed whose bound allows 1.05 reaches it, trading at most the repair's cost slack;
    seeds the repair does not touch give the same plan as without it."""
    options = PlannerOptions()
    for seed in range(10):
        workload = make_workload("image-heavy", 256, seed=seed)
        metrics = plan_step(workload, 128, COST, SPConfig(p_max=8)).metrics
        off = plan_step(workload, 128, COST, SPConfig(p_max=8), REPAIR_OFF).metrics
        sp8 = fixed_sp(workload, 128, COST, 8, 8).metrics
        assert metrics.attention_balance <= off.attention_balance + 1e-12
        assert metrics.attention_balance >= metrics.attention_balance_bound - 1e-9
        if metrics.attention_balance_bound < options.attention_target / (1 + options.balance_tolerance):
            assert metrics.attention_balance <= options.attention_target, seed
        if metrics.attention_balance == off.attention_balance:
            assert metrics.cost_balance == off.cost_balance
        assert metrics.cost_balance <= 1.03
        floor = sp8.efficiency / (1 + options.attention_repair_slack) - 2 * options.balance_tolerance
        assert metrics.efficiency >= max(0.97, floor)


@st.composite
def repair_cases(draw):
    num_blocks = draw(st.integers(2, 8))
    lengths = draw(st.lists(st.integers(1, 40_000), min_size=2, max_size=60))
    blocks = np.array(draw(st.lists(st.integers(0, num_blocks - 1), min_size=len(lengths),
                                    max_size=len(lengths))), dtype=np.int64)
    values = _values(lengths)
    sums = _sums(values, blocks, num_blocks)
    token_room = np.inf
    if draw(st.booleans()):
        token_room = float(sums[2].max()) * draw(st.floats(1.0, 1.5))
    slack = draw(st.floats(0.0, 0.05))
    goal = float(sums[1].mean()) * draw(st.floats(1.0, 1.3))
    return values, blocks, num_blocks, token_room, slack, goal, draw(st.integers(0, 40))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(repair_cases())
def test_repair_keeps_every_block_under_its_caps_and_never_raises_the_peak(case):
    values, blocks, num_blocks, token_room, slack, goal, steps = case
    before = _sums(values, blocks, num_blocks)
    original = blocks.copy()
    made = repair_attention(values, blocks, num_blocks, token_room, slack, goal, steps)
    after = _sums(values, blocks, num_blocks)
    assert 0 <= made <= steps
    assert blocks.dtype == original.dtype and ((blocks >= 0) & (blocks < num_blocks)).all()
    assert after[0].max() <= before[0].max() * (1 + slack) * (1 + 1e-9)
    assert after[2].max() <= token_room * (1 + 1e-9)
    assert after[1].max() <= before[1].max() * (1 + 1e-9)
    assert np.allclose(after.sum(axis=1), before.sum(axis=1))
    if made == 0:
        assert (blocks == original).all()
    if before[1].max() <= goal:
        assert made == 0


@st.composite
def planner_cases(draw):
    world_size = draw(st.sampled_from([16, 32]))
    lengths = draw(st.lists(st.integers(100, draw(st.sampled_from([4_000, 12_000]))), min_size=24, max_size=80))
    cap = None
    if draw(st.booleans()):
        need = max(-(-max(lengths) // 8), -(-sum(lengths) // world_size))
        cap = int(need * draw(st.floats(1.05, 2.0))) + 1
    workload = Workload(tuple(SequenceSpec(id=f"q{i}", tokens=n) for i, n in enumerate(lengths)))
    target = draw(st.floats(1.0, 1.03))
    return workload, world_size, SPConfig(p_max=8, max_tokens_per_rank=cap), target


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planner_cases())
def test_plans_with_the_repair_forced_on_are_valid(case):
    """A low attention target makes the repair run on most workloads: plans stay valid, aligned,
    deadlock-free and under the token cap."""
    workload, world_size, sp, target = case
    try:
        result = plan_step(workload, world_size, COST, sp, PlannerOptions(attention_target=target))
    except ValueError as error:
        assert sp.max_tokens_per_rank is not None and "max_tokens_per_rank" in str(error)
        return
    validate_plan(result.plan, workload)
    assert check_schedule(result.plan).deadlock_free
    if sp.max_tokens_per_rank is not None:
        assert result.metrics.max_rank_tokens <= sp.max_tokens_per_rank + 1e-6
    assert result.metrics.attention_balance >= result.metrics.attention_balance_bound - 1e-9


@pytest.mark.parametrize("bad", [dict(attention_target=0.0), dict(attention_repair_slack=-0.01),
                                 dict(attention_repair_steps=-1), dict(attention_repair_steps=2.5),
                                 dict(attention_search_cost_cap=-0.1),
                                 dict(attention_search_cost_cap=float("inf"))])
def test_bad_repair_options_fail_naming_the_option(bad):
    (name,) = bad
    with pytest.raises(ValueError, match=name):
        PlannerOptions(**bad)
