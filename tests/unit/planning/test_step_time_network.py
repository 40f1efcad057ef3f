"""The all-to-all network model: a group inside a node pays its NVLink link; a group spanning nodes
sends the remote share of its bytes over the network in parallel with the rest over NVLink.
References are the module docstring's formulas written out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexrl_ds.bench.workloads import make_step
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.planning.plan import Pack, Plan
from flexrl_ds.planning.planner import plan_step
from flexrl_ds.planning.schedule import hsf_rank_order
from flexrl_ds.planning.step_time import Link, LinkOverrides, StepTimeModel, describe_links, plan_step_time

HEADS, KV, HEAD_DIM, LAYERS = 28, 4, 128, 2
NVLINK_2, NVLINK_8, NETWORK = Link(1e-5, 2e11), Link(2e-5, 1e11), Link(5e-5, 1e10)
MODEL = StepTimeModel((1e-10, 0.0, 1e-3), (1e-6, 0.0), LAYERS, {2: NVLINK_2, 8: NVLINK_8}, 8, NETWORK)
SHIPPED = Path(__file__).resolve().parents[3] / "ds_configs" / "calibration" / "2xh200_bf16.json"


def _bytes_sent(tokens: float, degree: int, kv_held: int) -> float:
    """fwd + bwd: each rank sends (d−1)/d of its T/d tokens' q, k, v, out head vectors (bf16)."""
    return 2 * tokens / degree * (degree - 1) / degree * (2 * HEADS + 2 * kv_held) * HEAD_DIM * 2


def test_a_group_inside_a_node_pays_nvlink_only():
    tokens = 8000.0
    # degree 8 on 4 KV heads: every rank holds one KV head (8 held over the group)
    expected = LAYERS * (4 * NVLINK_8.latency_s + _bytes_sent(tokens, 8, 8) / NVLINK_8.bytes_per_s)
    assert MODEL.all_to_all_s(tokens, 8, HEADS, KV, HEAD_DIM) == pytest.approx(expected, rel=1e-12)
    slow_network = LinkOverrides(network_bytes_per_s=1e6, network_latency_s=1.0).apply(MODEL)
    assert slow_network.all_to_all_s(tokens, 8, HEADS, KV, HEAD_DIM) == pytest.approx(expected, rel=1e-12)


def test_a_group_spanning_nodes_pays_the_network_for_its_remote_share():
    tokens = 8000.0
    sent = _bytes_sent(tokens, 16, 16)
    remote = 8 / 15  # of a rank's 15 peers, 8 sit on the other node
    expected = LAYERS * (4 * max(NVLINK_8.latency_s, NETWORK.latency_s)
                         + max(sent * (1 - remote) / NVLINK_8.bytes_per_s, sent * remote / NETWORK.bytes_per_s))
    assert MODEL.all_to_all_s(tokens, 16, HEADS, KV, HEAD_DIM) == pytest.approx(expected, rel=1e-12)
    nvlink_only = LAYERS * (4 * NVLINK_8.latency_s + sent / NVLINK_8.bytes_per_s)
    assert expected > 3 * nvlink_only  # the 10 GB/s network dominates


def test_fewer_gpus_per_node_make_a_degree_8_group_span_nodes():
    model = LinkOverrides(gpus_per_node=4).apply(MODEL)
    tokens, sent, remote = 8000.0, _bytes_sent(8000.0, 8, 8), 4 / 7
    local = NVLINK_2  # no 4-GPU figure: the nearest smaller group size's, marked assumed
    expected = LAYERS * (4 * max(local.latency_s, NETWORK.latency_s)
                         + max(sent * (1 - remote) / local.bytes_per_s, sent * remote / NETWORK.bytes_per_s))
    assert model.all_to_all_s(tokens, 8, HEADS, KV, HEAD_DIM) == pytest.approx(expected, rel=1e-12)
    assert not model.link(4).measured and model.link(2).measured


def test_overrides_are_marked_assumed_and_described():
    model = LinkOverrides(nvlink_bytes_per_s=4e11, network_bytes_per_s=5e10).apply(MODEL)
    assert all(not link.measured for link in model.links.values()) and not model.network.measured
    assert model.network.latency_s == NETWORK.latency_s and model.links[2].latency_s == NVLINK_2.latency_s
    lines = describe_links(load_cost_model("qwen2.5-vl-7b", SHIPPED).step, 16)
    assert [line.split(":")[0] for line in lines] == ["d=2", "d=4", "d=8", "d=16"]
    assert "(measured)" in lines[0] and "(assumed)" in lines[1] and "(assumed)" in lines[2]
    assert "spans 2 nodes" in lines[3] and "network" in lines[3] and "spans" not in lines[2]
    with pytest.raises(ValueError):
        LinkOverrides(gpus_per_node=0)


def test_only_packs_spanning_nodes_feel_the_network_in_a_step():
    tokens = {"a": 30000, "b": 20000, "c": 3000}
    packs = [Pack(0, 16, tuple(range(16)), ("a",)), Pack(1, 8, tuple(range(8)), ("b",)),
             Pack(2, 1, (15,), ("c",))]
    wide = Plan(16, 16, tuple(packs), hsf_rank_order(packs, 16))
    narrow_packs = packs[1:]
    narrow = Plan(16, 16, tuple(narrow_packs), hsf_rank_order(narrow_packs, 16))
    slow = LinkOverrides(network_bytes_per_s=1e9).apply(MODEL)
    args = (HEADS, KV, HEAD_DIM, False)
    assert plan_step_time(wide, tokens, slow, *args).step_s > plan_step_time(wide, tokens, MODEL, *args).step_s
    assert plan_step_time(narrow, tokens, slow, *args).step_s == plan_step_time(narrow, tokens, MODEL, *args).step_s


def test_mean_compute_exposed_and_idle_sum_to_the_step():
    cost = load_cost_model("qwen2.5-vl-7b", SHIPPED)
    for seed in range(3):
        metrics = plan_step(make_step("video-heavy", 32, 1, seed), 16, cost, SPConfig(p_max=16)).metrics
        total = metrics.mean_compute_s + metrics.mean_exposed_all_to_all_s + metrics.idle_s
        assert total == pytest.approx(metrics.step_time_s, rel=1e-9)
        assert metrics.mean_compute_s <= metrics.step_time_s and metrics.idle_s >= 0
