"""HSF order and the collective-matching deadlock checker."""

from __future__ import annotations

import itertools
import random

import pytest

from flexrl_ds.planning.plan import Pack, Plan, validate_plan
from flexrl_ds.planning.schedule import check_schedule, hsf_rank_order, require_deadlock_free


def _pack(pack_id: int, degree: int, start: int) -> Pack:
    return Pack(pack_id, degree, tuple(range(start, start + degree)), (f"s{pack_id}",))


def _plan(packs, order, world_size=4) -> Plan:
    return Plan(world_size=world_size, p_max=4, packs=tuple(packs), rank_order=order)


NESTED = [_pack(0, 2, 0), _pack(1, 2, 2), _pack(2, 4, 0), _pack(3, 1, 0), _pack(4, 2, 0)]


def test_hsf_order_is_valid_and_deadlock_free():
    plan = _plan(NESTED, hsf_rank_order(NESTED, 4))
    validate_plan(plan)
    assert plan.rank_order[0] == (2, 0, 4, 3)
    result = check_schedule(plan)
    assert result.deadlock_free and result.num_collectives_run == len(NESTED)


def test_a_non_hsf_order_can_deadlock():
    # Rank 0 runs its degree-2 pack first, rank 1 the degree-4 pack first: each waits for the other.
    order = {0: (0, 2, 4, 3), 1: (2, 0, 4), 2: (2, 1), 3: (2, 1)}
    plan = _plan(NESTED, order)
    with pytest.raises(ValueError, match="Highest-Sharding-First"):
        validate_plan(plan)
    result = check_schedule(plan)
    assert not result.deadlock_free
    assert result.blocked[0] == 0 and result.blocked[1] == 2
    with pytest.raises(ValueError, match="DEADLOCK"):
        require_deadlock_free(plan)


def test_equal_degree_packs_in_different_orders_deadlock():
    order = {0: (2, 0, 4, 3), 1: (2, 4, 0), 2: (2, 1), 3: (2, 1)}
    assert not check_schedule(_plan(NESTED, order)).deadlock_free


def test_checker_accepts_any_restriction_of_one_global_order():
    # Lowest-degree-first is not HSF, but it is the restriction of a global order: no deadlock.
    rng = random.Random(0)
    for _ in range(50):
        global_order = NESTED[:]
        rng.shuffle(global_order)
        order = {r: tuple(p.id for p in global_order if r in p.ranks) for r in range(4)}
        assert check_schedule(_plan(NESTED, order)).deadlock_free


def test_checker_agrees_with_brute_force_on_small_orders():
    """Deadlock-free iff some interleaving runs every collective (exhaustive over rank 0/1 orders)."""
    packs = [_pack(0, 2, 0), _pack(1, 2, 0), _pack(2, 4, 0)]
    for order0 in itertools.permutations((0, 1, 2)):
        for order1 in itertools.permutations((0, 1, 2)):
            order = {0: order0, 1: order1, 2: (2,), 3: (2,)}
            expected = order0 == order1  # two ranks sharing all three packs must agree
            assert check_schedule(_plan(packs, order)).deadlock_free == expected
