"""The metrics charge each rank the attention FLOPs of the heads the executor gives it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.planning.metrics import plan_metrics
from flexrl_ds.planning.plan import SequenceSpec, Workload, parse_plan
from flexrl_ds.planning.planner import plan_step
from flexrl_ds.sp.attention import _heads_of
from flexrl_ds.sp.layout import build_rank_layout

COST = load_cost_model("qwen2.5-vl-7b")


def _with_heads(num_heads: int, num_kv_heads: int):
    return replace(COST, shapes=replace(COST.shapes, num_heads=num_heads, num_kv_heads=num_kv_heads))


def _executor_flops(plan, lengths, num_heads, num_kv_heads, head_dim):
    """Per-rank causal-attention FLOPs as the executor runs them: for every pack of the rank's
    layout, the head slice its attention computes on (sp/attention.py), 2·L²·heads·head_dim each."""
    out, held = [], {}
    for rank in range(plan.world_size):
        layout = build_rank_layout(plan, lengths, rank, num_heads=num_heads, num_kv_heads=num_kv_heads)
        flops = 0.0
        for shard in layout.packs:
            heads = _heads_of(shard, num_heads, num_kv_heads)[shard.rank_in_group]
            flops += sum(2.0 * n * n * heads.num_q * head_dim for n in shard.sequence_lengths)
            held.setdefault(shard.pack_id, {})[shard.rank_in_group] = heads.num_q
        out.append(flops)
    return np.array(out), {pack: [ranks[i] for i in sorted(ranks)] for pack, ranks in held.items()}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(num_kv_heads=st.integers(1, 8), group=st.integers(1, 7), world_size=st.sampled_from([2, 4, 8, 16, 32]),
       lengths=st.lists(st.integers(1, 40_000), min_size=1, max_size=20))
def test_metrics_attention_is_the_executor_head_split(num_kv_heads, group, world_size, lengths):
    num_heads = num_kv_heads * group
    cost = _with_heads(num_heads, num_kv_heads)
    workload = Workload(tuple(SequenceSpec(f"s{i}", n) for i, n in enumerate(lengths)))
    result = plan_step(workload, world_size, cost, SPConfig(p_max=world_size))
    by_id = {s.id: s.tokens for s in workload.sequences}
    flops, held = _executor_flops(result.plan, by_id, num_heads, num_kv_heads, cost.shapes.head_dim)
    # rank_attention is in units of L² of a whole sequence with all heads (2·L²·H·head_dim FLOPs).
    expected = flops / (2.0 * num_heads * cost.shapes.head_dim)
    assert np.allclose(result.metrics.rank_attention, expected, rtol=1e-9, atol=1e-6)
    for pack in result.plan.packs:  # the plan file records the split the executor makes
        assert list(pack.heads) == held[pack.id]


def test_plan_file_heads_round_trip_and_old_files_load():
    workload = Workload((SequenceSpec("long", 30_000),) + tuple(SequenceSpec(f"s{i}", 900) for i in range(20)))
    plan = plan_step(workload, 8, COST, SPConfig(p_max=8)).plan
    raw = plan.to_json()
    eight = [p for p in raw["packs"] if p["degree"] == 8]
    assert eight and eight[0]["heads"] == [4, 3, 4, 3, 4, 3, 4, 3]  # 28 heads, 4 KV heads, degree 8
    assert parse_plan(raw).packs == plan.packs
    for pack in raw["packs"]:
        del pack["heads"]  # a plan file written before the field
    old = parse_plan(raw)
    assert all(p.heads == () for p in old.packs)
    by_id = {s.id: s.tokens for s in workload.sequences}
    true = plan_metrics(plan, by_id, COST.c, COST.num_heads, COST.num_kv_heads)
    even = plan_metrics(old, by_id, COST.c)
    assert true.attention_balance > even.attention_balance  # 8/7 on the 4-head ranks


def test_bad_heads_field_is_rejected():
    from flexrl_ds.planning.plan import validate_plan

    workload = Workload((SequenceSpec("a", 5000),))
    raw = plan_step(workload, 2, COST, SPConfig(p_max=2)).plan.to_json()
    raw["packs"][0]["heads"] = [28]
    with pytest.raises(ValueError, match="heads"):
        validate_plan(parse_plan(raw), workload)
