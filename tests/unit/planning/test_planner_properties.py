"""Property tests over random workloads: every plan the planner (or a baseline) returns is valid."""

from __future__ import annotations

import pytest
from brute_force import tokens_per_rank
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.baselines import fixed_sp, lpt_bucketing, verl_bucketing
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.planning.plan import SequenceSpec, Workload, validate_plan
from flexrl_ds.planning.planner import PlannerOptions, plan_step
from flexrl_ds.planning.schedule import check_schedule

COST = load_cost_model("qwen2.5-vl-7b")


@st.composite
def planning_cases(draw, max_sequences: int = 40):
    world_size = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64]))
    p_max = draw(st.sampled_from([1, 2, 4, 8, 16]))
    if p_max <= world_size and world_size % p_max:
        p_max = 1
    long_tail = draw(st.booleans())
    high = 60_000 if long_tail else 3_000
    lengths = draw(st.lists(st.integers(1, high), min_size=1, max_size=max_sequences))
    p_eff = min(p_max, world_size)
    cap = None
    if draw(st.booleans()):
        # A feasible cap: room for everything on average, and for the longest at p_eff.
        need = max(-(-max(lengths) // p_eff), -(-sum(lengths) // world_size))
        cap = int(need * draw(st.floats(1.0, 3.0))) + 1
    h_pack = draw(st.sampled_from([None, 64, 1024]))
    head_rule = draw(st.sampled_from(["uneven", "divisible"]))
    workload = Workload(tuple(SequenceSpec(id=f"q{i}", tokens=n) for i, n in enumerate(lengths)))
    return workload, world_size, SPConfig(p_max=p_max, max_tokens_per_rank=cap, h_pack=h_pack), head_rule


def _check(workload, world_size, sp, head_rule):
    try:
        result = plan_step(workload, world_size, COST, sp, PlannerOptions(head_rule=head_rule))
    except ValueError as error:
        # Only a cap that packing granularity cannot meet may fail, and it must say so.
        assert sp.max_tokens_per_rank is not None and "max_tokens_per_rank" in str(error)
        return
    plan = result.plan
    validate_plan(plan, workload)  # every sequence exactly once, aligned power-of-two groups, HSF
    assert check_schedule(plan).deadlock_free
    if sp.max_tokens_per_rank is not None:
        assert tokens_per_rank(plan, workload).max() <= sp.max_tokens_per_rank + 1e-6
    if head_rule == "divisible":
        assert all(COST.num_heads % p.degree == 0 for p in plan.packs)
    assert 0 < result.metrics.efficiency <= result.metrics.efficiency_bound + 1e-9 <= 1 + 2e-9
    assert result.metrics.attention_balance >= result.metrics.attention_balance_bound - 1e-9
    ids = [s for p in plan.packs for s in p.sequences]
    assert sorted(ids) == sorted(s.id for s in workload.sequences)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planning_cases(max_sequences=24))
def test_planner_plans_are_valid(case):
    _check(*case)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planning_cases(max_sequences=120))
def test_planner_plans_are_valid_many(case):
    _check(*case)


@settings(max_examples=200, deadline=None)
@given(planning_cases())
def test_baseline_plans_are_valid(case):
    workload, world_size, sp, _ = case
    results = [verl_bucketing(workload, world_size, COST, sp.p_max), lpt_bucketing(workload, world_size, COST, sp.p_max)]
    results += [fixed_sp(workload, world_size, COST, d, max(sp.p_max, d)) for d in (2, 4, 8)
                if d <= world_size]
    for result in results:
        validate_plan(result.plan, workload)
        assert check_schedule(result.plan).deadlock_free
