"""FlexUlysses attention on 4 and 8 gloo ranks equals single-process attention (outputs and grads)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from harness import cached_group_tree
from plans import check_against_reference as _check
from plans import random_plan, rank_run_plans

from flexrl_ds.sp.layout import build_rank_layout

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]


@pytest.mark.parametrize("overlap", [True, False])
def test_four_ranks_fp64_mixed_degrees_gqa(dist_pools, overlap):
    seeds = list(range(6))
    args = dict(domain_size=4, p_max=4, num_heads=4, num_kv_heads=2, head_dim=8, dtype="float64")
    per_rank = dist_pools(4).run(rank_run_plans, seeds, overlap=overlap, **args)
    _check(per_rank, seeds, world_size=4, **args)
    paths = {p for result in per_rank[0] for p in result["paths"]}
    assert "flex-async" in paths if overlap else "flex-async" not in paths


def test_four_ranks_deepspeed_exchange_used_where_it_fits(dist_pools):
    """Without overlap, packs with equal shards and divisible heads go through DeepSpeed's _SeqAllToAll."""
    pytest.importorskip("deepspeed")
    seeds = list(range(8))
    args = dict(domain_size=4, p_max=4, num_heads=4, num_kv_heads=4, head_dim=4, dtype="float64")
    per_rank = dist_pools(4).run(rank_run_plans, seeds, overlap=False, **args)
    _check(per_rank, seeds, world_size=4, **args)
    paths = {p for rank in per_rank for result in rank for p in result["paths"]}
    assert {"deepspeed", "flex"} <= paths, paths


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_eight_ranks_degrees_up_to_eight(dist_pools, dtype):
    """Degrees 1..8, 8 heads with 2 KV heads: at degree 4 and 8 KV heads are replicated."""
    seeds = list(range(4))
    args = dict(domain_size=8, p_max=8, num_heads=8, num_kv_heads=2, head_dim=4, dtype=dtype)
    per_rank = dist_pools(8).run(rank_run_plans, seeds, overlap=True, **args)
    _check(per_rank, seeds, world_size=8, **args)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(28, 4), (12, 3), (10, 10)])
def test_eight_ranks_uneven_heads(dist_pools, num_heads, num_kv_heads):
    """Heads not divisible by the degree: Qwen2.5-VL-7B's 28/4 at p=8, and two odd shapes."""
    seeds = [11, 12]
    args = dict(domain_size=8, p_max=8, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=2,
                dtype="float64", max_len=12)
    per_rank = dist_pools(8).run(rank_run_plans, seeds, overlap=True, **args)
    _check(per_rank, seeds, world_size=8, **args)


def test_eight_ranks_two_domains(dist_pools):
    """World 8 = two SP domains of 4 (data-parallel replicas), each with its own plan."""
    seeds = [21, 22, 23]
    args = dict(domain_size=4, p_max=4, num_heads=4, num_kv_heads=1, head_dim=4, dtype="float64")
    per_rank = dist_pools(8).run(rank_run_plans, seeds, overlap=True, **args)
    _check(per_rank, seeds, world_size=8, **args)


def test_fixed_sp_baseline_through_deepspeed(dist_pools):
    """The baseline: DeepSpeed's DistributedAttention on fixed groups of 2 (padding sequences added)."""
    pytest.importorskip("deepspeed")
    seeds = [31, 32]
    args = dict(domain_size=4, p_max=2, num_heads=4, num_kv_heads=2, head_dim=4, dtype="float64", fixed=True)
    per_rank = dist_pools(4).run(rank_run_plans, seeds, overlap=False, **args)
    _check(per_rank, seeds, world_size=4, **args)
    assert per_rank[0][0]["paths"] == "deepspeed"


def test_hundreds_of_random_plans_without_hang(dist_pools):
    """200 random plans on 8 ranks (tiny shapes), overlap on: every one completes; a sample is checked."""
    seeds = list(range(1000, 1200))
    args = dict(domain_size=8, p_max=8, num_heads=8, num_kv_heads=2, head_dim=2, dtype="float64", max_len=6)
    per_rank = dist_pools(8).run(rank_run_plans, seeds, overlap=True, timeout_s=200, **args)
    assert all(len(results) == len(seeds) for results in per_rank)
    sample = seeds[::25]
    _check([[r[seeds.index(s)] for s in sample] for r in per_rank], sample, world_size=8, **args)


def test_empty_shards_and_idle_ranks(dist_pools):
    """A 3-token pack at degree 4 (one rank holds nothing of it) and a rank with no pack at all."""
    from flexrl_ds.planning.plan import Pack, Plan

    tiny = Plan(world_size=4, p_max=4, packs=(Pack(0, 4, (0, 1, 2, 3), ("a",)), Pack(1, 2, (0, 1), ("b", "c")),
                                              Pack(2, 1, (2,), ("d",))),
                rank_order={0: (0, 1), 1: (0, 1), 2: (0, 2), 3: (0,)})
    idle = Plan(world_size=4, p_max=4, packs=(Pack(0, 2, (2, 3), ("e",)), Pack(1, 1, (0,), ("f",))),
                rank_order={0: (1,), 1: (), 2: (0,), 3: (0,)})
    explicit = [(tiny, {"a": 3, "b": 5, "c": 1, "d": 4}), (idle, {"e": 9, "f": 2})]
    args = dict(domain_size=4, p_max=4, num_heads=4, num_kv_heads=2, head_dim=4, dtype="float64",
                explicit=explicit)
    per_rank = dist_pools(4).run(rank_run_plans, [0, 1], overlap=True, **args)
    _check(per_rank, [0, 1], world_size=4, **args)
    assert per_rank[1][1]["out"].shape[0] == 0


def rank_bad_input(case):
    """Every rank must raise the same ValueError before any collective; then a barrier proves no one waits."""
    tree = cached_group_tree(4, 2 if case == "missing_group" else 4)
    plan, lengths = random_plan(5, 4, 4)
    kwargs = dict(num_heads=4, num_kv_heads=2)
    if case == "world_size":
        plan, lengths = random_plan(5, 2, 2)
    elif case == "missing_group":  # the tree stops at degree 2, the plan uses degree 4
        seed = next(s for s in range(100) if max(p.degree for p in random_plan(s, 4, 4)[0].packs) == 4)
        plan, lengths = random_plan(seed, 4, 4)
    elif case == "heads":
        kwargs = dict(num_heads=2, num_kv_heads=2)
    elif case == "token_cap":
        kwargs["max_tokens_per_rank"] = 3
    try:
        build_rank_layout(plan, lengths, tree.local_rank, tree, **kwargs)
        message = None
    except ValueError as error:
        message = str(error)
    dist.barrier()
    return message


@pytest.mark.parametrize("case,expected", [("world_size", "world_size"), ("missing_group", "group tree"),
                                           ("heads", "heads"), ("token_cap", "token cap")])
def test_bad_input_detected_on_every_rank(dist_pools, case, expected):
    messages = dist_pools(4).run(rank_bad_input, case, timeout_s=60)
    assert all(m is not None and expected in m for m in messages), messages
    assert len(set(messages)) == 1, messages
