"""Pure parts of FlexUlysses execution (no process group): topology, layout, head partition, launch env."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from plans import random_plan

from flexrl_ds.parallel.group_tree import SPTopology
from flexrl_ds.parallel.launch import read_launch_env
from flexrl_ds.sp.all_to_all import head_partition
from flexrl_ds.sp.fixed_sp import fixed_sp_plan
from flexrl_ds.sp.layout import build_rank_layout, shard_bounds
from flexrl_ds.planning.plan import validate_plan


def test_topology_blocks_are_aligned_and_nested():
    topology = SPTopology(world_size=16, domain_size=8, p_max=4)
    blocks = topology.blocks()
    assert len(blocks) == 2 * (4 + 2)  # per domain: four blocks of 2, two of 4
    for _, degree, ranks in blocks:
        assert ranks[0] % degree == 0 and len(ranks) == degree
    for _, _, a in blocks:
        for _, _, b in blocks:
            assert set(a) <= set(b) or set(b) <= set(a) or not set(a) & set(b)
    assert topology.domain_of(9) == 1 and topology.local_rank(9) == 1


@pytest.mark.parametrize("world,domain,p_max,extra", [
    (8, 4, 4, []),                                            # the degree-4 blocks span each domain
    (8, 4, 2, [(0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))]),        # no block spans a domain: one group each
    (8, 4, 1, [(0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))]),
    (4, 1, 1, [(0, (0,)), (1, (1,)), (2, (2,)), (3, (3,))]),  # domains of one rank
    (8, 8, 4, [(0, tuple(range(8)))]),
])
def test_every_domain_gets_a_domain_wide_group(world, domain, p_max, extra):
    topology = SPTopology(world_size=world, domain_size=domain, p_max=p_max)
    assert topology.domain_groups_to_create() == extra
    spanning = {ranks for _, degree, ranks in topology.blocks() if degree == domain}
    for d in range(topology.num_domains):
        ranks = topology.domain_ranks(d)
        assert ranks == tuple(r for r in range(world) if topology.domain_of(r) == d)
        assert (ranks in spanning) != ((d, ranks) in extra)  # exactly one source of the domain group
    with pytest.raises(ValueError, match="outside"):
        topology.domain_ranks(topology.num_domains)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(world_size=8, domain_size=3, p_max=1), "does not divide"),
    (dict(world_size=8, domain_size=8, p_max=6), "power of two"),
    (dict(world_size=8, domain_size=4, p_max=8), "exceeds domain_size"),
])
def test_topology_rejects_bad_sizes(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        SPTopology(**kwargs)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), world_exp=st.integers(0, 3))
def test_layout_covers_every_token_once(seed, world_exp):
    world_size = 2 ** world_exp
    plan, lengths = random_plan(seed, world_size, world_size)
    seen = {s: [0] * n for s, n in lengths.items()}
    for rank in range(world_size):
        layout = build_rank_layout(plan, lengths, rank)
        degrees = [p.degree for p in layout.packs]
        assert degrees == sorted(degrees, reverse=True)  # HSF
        local = 0
        for seq_id, lo, hi, local_index in layout.segments():
            assert local_index == local
            local += hi - lo
            for position in range(lo, hi):
                seen[seq_id][position] += 1
        assert local == layout.num_local_tokens
    assert all(count == 1 for counts in seen.values() for count in counts)


def test_slice_tokens_follows_local_order():
    plan, lengths = random_plan(3, 4, 4)
    position_ids = {s: torch.arange(n).expand(3, n) + 1000 * int(s[1:]) for s, n in lengths.items()}
    for rank in range(4):
        layout = build_rank_layout(plan, lengths, rank)
        sliced = layout.slice_tokens(position_ids, dim=-1)
        assert sliced.shape == (3, layout.num_local_tokens)
        for seq_id, lo, hi, local_index in layout.segments():
            expected = torch.arange(lo, hi) + 1000 * int(seq_id[1:])
            assert torch.equal(sliced[1, local_index:local_index + hi - lo], expected)


def test_shard_bounds_even_as_possible():
    assert shard_bounds(10, 4) == (0, 3, 6, 8, 10)
    assert shard_bounds(2, 4) == (0, 1, 2, 2, 2)


@pytest.mark.parametrize("num_heads,num_kv_heads,degree", [(28, 4, 8), (28, 4, 2), (8, 1, 8), (12, 3, 8),
                                                           (10, 10, 4), (32, 8, 4)])
def test_head_partition_covers_heads_with_their_kv(num_heads, num_kv_heads, degree):
    parts = head_partition(num_heads, num_kv_heads, degree)
    assert len(parts) == degree
    assert [p.q_start for p in parts[1:]] == [p.q_end for p in parts[:-1]] and parts[-1].q_end == num_heads
    group = num_heads // num_kv_heads
    for part in parts:
        assert part.num_q >= 1
        assert all(part.kv_start <= h // group < part.kv_end for h in range(part.q_start, part.q_end))
    assert max(p.num_q for p in parts) - min(p.num_q for p in parts) <= max(1, group)


def test_fixed_sp_plan_is_valid_and_padded():
    lengths = {f"s{i}": n for i, n in enumerate([7, 30, 3, 12, 5])}
    plan, padded = fixed_sp_plan(lengths, world_size=4, degree=2)
    validate_plan(plan, list(padded))
    for pack in plan.packs:
        assert sum(padded[s] for s in pack.sequences) % 2 == 0


def test_layout_errors_name_the_problem():
    plan, lengths = random_plan(1, 4, 4)
    with pytest.raises(ValueError, match="heads"):
        build_rank_layout(plan, lengths, 0, num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="outside"):
        build_rank_layout(plan, lengths, 5)
    with pytest.raises(ValueError, match="length must be a positive integer"):
        build_rank_layout(plan, {**lengths, "s0": 0}, 0)


def test_launch_env_reads_torchrun_and_mpi_variables():
    env = read_launch_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.master_port) == (3, 4, 1, 1234)
    mpi = read_launch_env({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8"})
    assert (mpi.rank, mpi.world_size, mpi.local_rank) == (2, 8, 2)
    assert read_launch_env({}).world_size == 1
    with pytest.raises(ValueError, match="RANK"):
        read_launch_env({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="not inside"):
        read_launch_env({"RANK": "4", "WORLD_SIZE": "4"})
