"""Calibrated step-time objective: the model against a plain loop, and the planner minimising it."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexrl_ds.bench.workloads import make_step
from flexrl_ds.planning.baselines import fixed_sp
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import load_cost_model, shipped_calibration
from flexrl_ds.planning.heads import head_partition
from flexrl_ds.planning.plan import SequenceSpec, Workload
from flexrl_ds.planning.planner import plan_step

SHIPPED = Path(__file__).resolve().parents[3] / "ds_configs" / "calibration" / "2xh200_bf16.json"
COST = load_cost_model("qwen2.5-vl-7b", SHIPPED)


def _loop_step_time(plan, tokens, cost, overlap=True):
    """Plain-loop reference of planning/step_time.py's formulas, from the calibration file's terms."""
    model = cost.step
    (a, b, c), (s, c_lin), layers = model.attention_fit, model.linear_fit, model.num_layers
    packs = {p.id: p for p in plan.packs}
    times = []
    for rank in range(plan.world_size):
        total, held, previous, last_degree = 0.0, 0.0, 0.0, 0
        for pack_id in plan.rank_order[rank]:
            pack = packs[pack_id]
            parts = head_partition(cost.num_heads, cost.num_kv_heads, pack.degree) if pack.degree > 1 else None
            q = parts[pack.ranks.index(rank)].num_q if parts else cost.num_heads
            lengths = [tokens[i] for i in pack.sequences]
            floor = 0.0 if pack.degree == 1 and last_degree == 1 else c  # degree-1 runs: one call
            last_degree = pack.degree
            attention = layers * (q / cost.num_heads * sum(a * n * n + b * n for n in lengths) + floor)
            comm = 0.0
            if parts:
                link = model.links[min(pack.degree, 8)] if min(pack.degree, 8) in model.links else model.link(pack.degree)
                vectors = sum(2 * p.num_q + 2 * p.num_kv for p in parts)
                sent = 2 * sum(lengths) / pack.degree * (pack.degree - 1) / pack.degree * vectors * 128 * 2
                comm = layers * (4 * link.latency_s + sent / link.bytes_per_s)
            total += attention + (max(0.0, comm - previous) if overlap else comm)
            held += sum(lengths) / pack.degree
            previous = attention
        times.append(total + layers * (s * held + c_lin))
    return max(times)


def test_step_time_matches_a_plain_loop():
    workload = make_step("image-heavy", 32, 1, seed=3)
    result = plan_step(workload, 8, COST, SPConfig(p_max=8))
    tokens = {s.id: s.tokens for s in workload.sequences}
    assert result.metrics.step_time_s == pytest.approx(_loop_step_time(result.plan, tokens, COST), rel=1e-9)
    assert result.metrics.compute_s + result.metrics.exposed_all_to_all_s == pytest.approx(result.metrics.step_time_s)


def test_a_ranks_degree_one_packs_pay_one_call_floor():
    workload = make_step("image-heavy", 48, 1, seed=5)
    result = plan_step(workload, 4, COST, SPConfig(p_max=1, h_pack=2048, H_pack=2048))
    tokens = {s.id: s.tokens for s in workload.sequences}
    assert max(len(order) for order in result.plan.rank_order.values()) >= 3  # several packs on a rank
    assert result.metrics.step_time_s == pytest.approx(_loop_step_time(result.plan, tokens, COST), rel=1e-9)


@pytest.mark.parametrize("mix", ["image-heavy", "video-heavy", "only-video"])
def test_planner_is_not_slower_than_fixed_sp_in_modelled_time(mix):
    for seed in range(2):
        workload = make_step(mix, 64, 1, seed)
        flex = plan_step(workload, 32, COST, SPConfig(p_max=8)).metrics
        for degree in (4, 8):
            fixed = fixed_sp(workload, 32, COST, degree, 8).metrics
            assert flex.step_time_s <= fixed.step_time_s * 1.01, (mix, seed, degree)


def test_short_sequences_stay_whole_when_the_floor_and_all_to_all_cost_more():
    """64 sequences of 900 tokens on 8 ranks: sharding any would add its own pack's attention floor
    on every rank of its group; the calibrated planner keeps all at degree 1."""
    workload = Workload(tuple(SequenceSpec(f"s{i}", 900) for i in range(64)))
    result = plan_step(workload, 8, COST, SPConfig(p_max=8))
    assert result.metrics.degree_histogram == {1: 64}


def test_auto_calibration_matches_device_and_model():
    shapes = load_cost_model("qwen2.5-vl-7b").shapes
    assert shipped_calibration(shapes, "NVIDIA H200") == SHIPPED
    assert shipped_calibration(shapes, None) is None
    assert shipped_calibration(shapes, "NVIDIA A100-SXM4-80GB") is None
    assert shipped_calibration(load_cost_model("qwen2.5-vl-32b").shapes, "NVIDIA H200") is None
    auto = load_cost_model("qwen2.5-vl-7b", "auto", device_name="NVIDIA H200")
    assert auto.step is not None and auto.c == pytest.approx(COST.c)
    assert load_cost_model("qwen2.5-vl-7b", "auto").step is None  # no accelerator named: formula
    measured = {d: link.measured for d, link in COST.step.links.items()}
    assert measured == {2: True, 4: False, 8: False}
