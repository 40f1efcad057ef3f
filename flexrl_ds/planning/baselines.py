"""Baselines in the planner's family, scored with the same metrics. Pure (numpy only).

- `verl_bucketing`: whole-sequence bucketing the way veRL balances a batch over data-parallel
  ranks: an equal number of sequences per rank, partitioned by Karmarkar–Karp (largest differencing
  over k-way partial partitions) on veRL's workload estimate `24576·L + L²`.
- `lpt_bucketing`: whole sequences, any count per rank, longest-processing-time on our cost
  `L² + c·L` (a stronger bucketing).
- `fixed_sp`: DeepSpeed-Ulysses with one fixed degree `d` for every sequence; sequences balanced
  over the `W/d` groups by LPT on cost.
All produce ordinary plans (packs, HSF rank_order) so they pass `validate_plan` and the schedule
checker like FlexUlysses plans.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

import numpy as np

from flexrl_ds.planning.cost_model import CostModel
from flexrl_ds.planning.metrics import PlanMetrics, compute_metrics, with_step_time
from flexrl_ds.planning.packing import PackingLimits, packing_limits
from flexrl_ds.planning.placement import lpt_groups  # noqa: F401  (re-exported: callers import it from here)
from flexrl_ds.planning.plan import Plan, Workload
from flexrl_ds.planning.planner import build_plan

VERL_LINEAR_COEFF = 24576
"""veRL's workload estimate per sequence is VERL_LINEAR_COEFF·L + L²."""


@dataclass(frozen=True)
class MethodResult:
    """A plan from one method, with its metrics."""

    name: str
    plan: Plan
    metrics: PlanMetrics


def karmarkar_karp(weights: list[float], num_parts: int, equal_size: bool) -> list[list[int]]:
    """k-way largest differencing: partial partitions merged largest-spread first.

    Each partial partition holds `num_parts` sets sorted by sum (largest first); merging two pairs
    the largest sets of one with the smallest of the other. With `equal_size`, sorted items are
    seeded `num_parts` at a time (one per set), so every final set gets the same count
    (`len(weights)` must then be a multiple of `num_parts`).
    """
    if equal_size and len(weights) % num_parts:
        raise ValueError(f"equal_size needs a multiple of {num_parts} items, got {len(weights)}")
    ranked = sorted(range(len(weights)), key=lambda i: (weights[i], i))
    tie = itertools.count()
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []

    def push(sets: list[tuple[float, list[int]]]) -> None:
        sets.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), next(tie), sets))

    if equal_size:
        for offset in range(0, len(ranked), num_parts):
            push([(weights[i], [i]) for i in ranked[offset:offset + num_parts]])
    else:
        for i in ranked:
            push([(weights[i], [i])] + [(0.0, []) for _ in range(num_parts - 1)])
    while len(heap) > 1:
        _, _, first = heapq.heappop(heap)
        _, _, second = heapq.heappop(heap)
        push([(a[0] + b[0], a[1] + b[1]) for a, b in zip(first, reversed(second))])
    return [sorted(items) for _, items in heap[0][2]]


def _result(name: str, workload: Workload, degrees: np.ndarray, starts: np.ndarray, world_size: int,
            p_max: int, cost: CostModel, limits: PackingLimits) -> MethodResult:
    heads = (cost.num_heads, cost.num_kv_heads)
    plan = build_plan(workload.sequences, degrees, starts, world_size, max(p_max, int(degrees.max())), limits,
                      heads if int(degrees.max()) <= cost.num_heads else None)
    tokens = np.array([s.tokens for s in workload.sequences], dtype=float)
    metrics = compute_metrics(tokens, degrees, starts, world_size=world_size, p_max=p_max, c=cost.c,
                              num_packs=len(plan.packs), num_heads=heads[0] if plan.packs[0].heads else None,
                              num_kv_heads=heads[1])
    return MethodResult(name, plan, with_step_time(metrics, plan, workload, cost))


def verl_bucketing(workload: Workload, world_size: int, cost: CostModel, p_max: int,
                   limits: PackingLimits | None = None) -> MethodResult:
    """veRL-style: equal counts per rank, Karmarkar–Karp on 24576·L + L².

    When the count is not a multiple of the world size, zero-weight placeholders pad it (veRL
    requires divisibility); ranks then differ by at most one real sequence.
    """
    tokens = [s.tokens for s in workload.sequences]
    weights = [VERL_LINEAR_COEFF * t + t * t for t in tokens]
    padding = (-len(weights)) % world_size
    parts = karmarkar_karp(weights + [0.0] * padding, world_size, equal_size=True)
    starts = np.zeros(len(tokens), dtype=np.int64)
    for rank, items in enumerate(parts):
        for i in items:
            if i < len(tokens):
                starts[i] = rank
    return _result("bucketing (veRL)", workload, np.ones(len(tokens), dtype=np.int64), starts, world_size,
                   p_max, cost, limits or packing_limits(None, None))


def lpt_bucketing(workload: Workload, world_size: int, cost: CostModel, p_max: int,
                  limits: PackingLimits | None = None) -> MethodResult:
    """Whole sequences, free count per rank, LPT on L² + c·L."""
    tokens = np.array([s.tokens for s in workload.sequences], dtype=float)
    starts = lpt_groups(tokens * tokens + cost.c * tokens, world_size)
    return _result("bucketing (LPT)", workload, np.ones(len(tokens), dtype=np.int64), starts, world_size,
                   p_max, cost, limits or packing_limits(None, None))


def fixed_sp(workload: Workload, world_size: int, cost: CostModel, degree: int, p_max: int,
             limits: PackingLimits | None = None) -> MethodResult:
    """Every sequence at Ulysses degree `degree`, LPT over the world_size/degree groups."""
    if degree < 1 or degree & (degree - 1) or world_size % degree:
        raise ValueError(f"fixed SP degree {degree} must be a power of two dividing world_size {world_size}")
    tokens = np.array([s.tokens for s in workload.sequences], dtype=float)
    groups = lpt_groups(tokens * tokens + cost.c * tokens, world_size // degree)
    degrees = np.full(len(tokens), degree, dtype=np.int64)
    return _result(f"SP={degree}", workload, degrees, groups * degree, world_size, p_max, cost,
                   limits or packing_limits(None, None))
