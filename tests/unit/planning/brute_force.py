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
