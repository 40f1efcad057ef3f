"""Degrees never exceed the model's query heads: every plan builds in the executor's layout code."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch

from flexrl_ds.models.processing import EncodedSample
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.planning.heads import head_partition
from flexrl_ds.planning.plan import SequenceSpec, Workload
from flexrl_ds.planning.planner import PlannerOptions, plan_step
from flexrl_ds.sp.layout import build_rank_layout
from flexrl_ds.tools.logprobs import plan_for_samples

COST = load_cost_model("qwen2.5-vl-7b")


def _with_heads(num_heads: int, num_kv_heads: int):
    shapes = replace(COST.shapes, num_heads=num_heads, num_kv_heads=num_kv_heads)
    return replace(COST, shapes=shapes, c=shapes.params_per_layer() / shapes.hidden_size)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_kv_heads=st.integers(1, 8), group=st.integers(1, 8),
       world_size=st.sampled_from([1, 2, 4, 8, 16, 32, 64]), p_max=st.sampled_from([1, 2, 4, 8, 16, 32, 64]),
       head_rule=st.sampled_from(["uneven", "divisible"]),
       lengths=st.lists(st.integers(1, 40_000), min_size=1, max_size=24))
def test_every_plan_builds_in_the_executor_layout(num_kv_heads, group, world_size, p_max, head_rule, lengths):
    num_heads = num_kv_heads * group
    if p_max < world_size and world_size % p_max:
        p_max = world_size
    cost = _with_heads(num_heads, num_kv_heads)
    workload = Workload(tuple(SequenceSpec(f"s{i}", n) for i, n in enumerate(lengths)))
    result = plan_step(workload, world_size, cost, SPConfig(p_max=p_max), PlannerOptions(head_rule=head_rule))
    plan, lengths_by_id = result.plan, {s.id: s.tokens for s in workload.sequences}
    for rank in range(world_size):
        layout = build_rank_layout(plan, lengths_by_id, rank, num_heads=num_heads, num_kv_heads=num_kv_heads)
        for shard in layout.packs:  # the executor's head split exists for every pack this rank runs
            assert len(head_partition(num_heads, num_kv_heads, shard.degree)) == shard.degree
    cap = plan.extra["degree_cap"]
    assert max(p.degree for p in plan.packs) <= cap["max_degree"] <= num_heads
    if head_rule == "divisible":
        assert all(num_heads % p.degree == 0 for p in plan.packs)


def test_long_sequence_on_32_ranks_stays_within_28_heads():
    workload = Workload((SequenceSpec("long", 3000),))
    plan = plan_step(workload, 32, COST, SPConfig(p_max=32)).plan
    assert max(p.degree for p in plan.packs) <= 16
    assert plan.extra["degree_cap"] == {"max_degree": 16, "by": "num_heads", "p_max": 32, "world_size": 32,
                                        "num_heads": 28}
    build_rank_layout(plan, {"long": 3000}, 0, num_heads=28, num_kv_heads=4)


def test_logprobs_plans_a_tiny_10_head_model_on_32_processes(tmp_path):
    config = {"hidden_size": 80, "intermediate_size": 160, "num_attention_heads": 10, "num_key_value_heads": 2,
              "num_hidden_layers": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    samples = {f"r{i}": EncodedSample(f"r{i}", torch.zeros(n, dtype=torch.long), 1)
               for i, n in enumerate([9000, 300, 200, 150])}
    plan = plan_for_samples(str(tmp_path), samples, num_procs=32, p_max=32)  # --nproc 32: p_max = 32
    assert max(p.degree for p in plan.packs) <= 8
    lengths = {k: s.length for k, s in samples.items()}
    for rank in range(32):
        build_rank_layout(plan, lengths, rank, num_heads=10, num_kv_heads=2)


def test_logprobs_names_the_sp_settings_it_does_not_use():
    from flexrl_ds.planning.config import SPConfig
    from flexrl_ds.tools.logprobs import unused_sp_settings

    assert unused_sp_settings(SPConfig(p_max=4), 4) == []  # the defaults, p_max as given: nothing to say
    lines = unused_sp_settings(SPConfig(p_max=8, domain_size=8, overlap=False, max_tokens_per_rank=100), 4)
    assert lines[0] == "flexrl.sp.p_max = 8 is replaced: --p-max / --nproc give 4"
    assert lines[1].startswith("flexrl.sp.domain_size = 8 is not used") and "overlap = false" in lines[2]
    assert len(lines) == 3  # max_tokens_per_rank is used by the planner


def test_metrics_of_a_saved_plan_with_p_max_above_the_heads_are_the_planners(tmp_path):
    """A plan file keeps the p_max asked for (32), above what 28 heads allow (16): its metrics,
    recomputed from the file, are those the planner reported (they used to fail on the head split)."""
    from flexrl_ds.bench.workloads import make_workload
    from flexrl_ds.planning.metrics import plan_metrics
    from flexrl_ds.planning.plan import load_plan

    cost = load_cost_model("qwen2.5-vl-7b")
    workload = make_workload("video-heavy", 64, 0)
    result = plan_step(workload, 32, cost, SPConfig(p_max=32))
    result.plan.save(tmp_path / "plan.json")
    saved = load_plan(tmp_path / "plan.json")
    assert saved.p_max == 32
    recomputed = plan_metrics(saved, {s.id: s.tokens for s in workload.sequences}, cost.c, cost.num_heads,
                              cost.num_kv_heads)
    for key in ("efficiency", "efficiency_bound", "attention_balance", "all_to_all_relative", "max_rank_cost"):
        assert getattr(recomputed, key) == pytest.approx(getattr(result.metrics, key), rel=1e-12), key
