"""Exhaustive references for the planner's bounds (tiny inputs only)."""

from __future__ import annotations

import itertools


def best_split(values, bins: int) -> float:
    """Smallest possible largest bin sum over every assignment of `values` to `bins` bins."""
    best = float("inf")
    for assignment in itertools.product(range(bins), repeat=len(values)):
        sums = [0.0] * bins
        for value, b in zip(values, assignment):
            sums[b] += value
        best = min(best, max(sums))
    return best


def tokens_per_rank(plan, workload):
    """Tokens each rank holds under `plan`, from its packs: an even split of each sequence over its pack."""
    import numpy as np

    tokens = {s.id: s.tokens for s in workload.sequences}
    held = np.zeros(plan.world_size)
    for pack in plan.packs:
        for seq_id in pack.sequences:
            held[list(pack.ranks)] += tokens[seq_id] / pack.degree
    return held
