"""Highest-Sharding-First (HSF) execution order and a collective-matching deadlock checker. Pure.

Every pack is one collective over its ranks (per layer: the all-to-alls of that pack). A rank
issues its packs in `rank_order` and blocks at its next pack until every rank of that pack has
reached it. `check_schedule` simulates exactly that and reports whether all ranks finish.

Why HSF cannot deadlock (groups are aligned power-of-two blocks, so any two are nested or disjoint):
order packs by (degree descending, group start, pack id) — one global total order — and give each
rank the restriction of that order to its own packs. The globally first pack not yet run has every
one of its ranks waiting exactly at it (each of its ranks has run every earlier pack of its own
list, and nothing earlier is pending anywhere), so it runs; by induction all packs run. Any order
that is the restriction of one global total order is deadlock-free; HSF is the one that also lets
the widest (most expensive, most communication-bound) packs start first and keeps equal-degree
packs of one group in the same relative order on all its ranks. `validate_plan` checks the HSF
rules; `check_schedule` checks the outcome for any order, HSF or not.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterable

from flexrl_ds.planning.plan import Pack, Plan


def hsf_key(pack: Pack) -> tuple[int, int, int]:
    """Sort key of the global HSF order: widest first, then by group, then by pack id."""
    return (-pack.degree, pack.ranks[0], pack.id)


def hsf_rank_order(packs: Iterable[Pack], world_size: int) -> dict[int, tuple[int, ...]]:
    """rank -> its pack ids in HSF order (the restriction of one global order to each rank)."""
    order: dict[int, list[int]] = {rank: [] for rank in range(world_size)}
    for pack in sorted(packs, key=hsf_key):
        for rank in pack.ranks:
            order[rank].append(pack.id)
    return {rank: tuple(ids) for rank, ids in order.items()}


@dataclass(frozen=True)
class ScheduleCheck:
    """Outcome of simulating collective matching."""

    deadlock_free: bool
    """True when every rank ran all of its packs."""
    num_collectives_run: int
    """Packs that completed."""
    blocked: dict[int, int] = field(default_factory=dict)
    """On deadlock: rank -> the pack id it is stuck at."""

    def describe(self) -> str:
        if self.deadlock_free:
            return f"deadlock-free ({self.num_collectives_run} collectives)"
        stuck = ", ".join(f"rank {r} at pack {p}" for r, p in sorted(self.blocked.items())[:8])
        return f"DEADLOCK after {self.num_collectives_run} collectives: {stuck}"


def check_schedule(plan: Plan) -> ScheduleCheck:
    """Simulate every rank walking `rank_order`; a pack runs once all of its ranks are waiting at it."""
    packs = plan.pack_by_id()
    position = {rank: 0 for rank in range(plan.world_size)}
    waiting: dict[int, int] = {pack_id: 0 for pack_id in packs}
    ready: deque[int] = deque()

    def arrive(rank: int) -> None:
        order = plan.rank_order.get(rank, ())
        if position[rank] < len(order):
            pack_id = order[position[rank]]
            if pack_id not in packs:
                raise ValueError(f"plan: rank_order[{rank}] names unknown pack {pack_id}")
            waiting[pack_id] += 1
            if waiting[pack_id] == packs[pack_id].degree:
                ready.append(pack_id)

    for rank in range(plan.world_size):
        arrive(rank)
    num_run = 0
    while ready:
        pack_id = ready.popleft()
        num_run += 1
        for rank in packs[pack_id].ranks:
            position[rank] += 1
            arrive(rank)
    blocked = {
        rank: plan.rank_order[rank][pos]
        for rank, pos in position.items()
        if pos < len(plan.rank_order.get(rank, ()))
    }
    return ScheduleCheck(deadlock_free=not blocked, num_collectives_run=num_run, blocked=blocked)


def require_deadlock_free(plan: Plan) -> None:
    """Raise ValueError naming the stuck ranks when `plan.rank_order` can deadlock."""
    result = check_schedule(plan)
    if not result.deadlock_free:
        raise ValueError(f"plan: rank_order {result.describe()}")
