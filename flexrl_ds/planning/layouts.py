"""Scoring candidate layouts of one step under the calibrated step-time model, and the greedy
layout that is one of the candidates. Pure (numpy only).

A layout is (degree, first rank) per sequence; `packed_groups` turns it into the packs the
executor runs (planning/packing.py) in HSF order, and `layout_step_time` scores those packs
exactly as `plan_step_time` scores the Plan built from them. `fixed_sp_time_floor` bounds fixed
SP's modelled time from below (the planner skips candidates that cannot win).

`greedy_layout` is moldable list scheduling: sequences in decreasing cost, each placed at the
degree and aligned group that least raise the step's lower bound (the busiest rank, or the mean
rank's work with the overheads the placement adds), smaller degrees first on ties. It is simple,
knows nothing of p-blocks or rooms, and is what the planner's chosen plan must never lose to
(planner.py `plan_step` scores it beside the nested layouts).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from flexrl_ds.planning.cost_model import CostModel
from flexrl_ds.planning.heads import heads_per_rank
from flexrl_ds.planning.packing import PackingLimits, pack_group
from flexrl_ds.planning.step_time import hsf_packs_step_time

TIE = 1e-9
"""Relative slack under which two greedy placements count as equally good (the smaller degree wins)."""


def greedy_layout(values: np.ndarray, overheads: dict[int, np.ndarray], shares: dict[int, np.ndarray],
                  allowed: tuple[int, ...], world_size: int, token_cap: float, min_shard_tokens: int
                  ) -> tuple[np.ndarray, np.ndarray] | None:
    """(degree, first rank) of every sequence by moldable list scheduling (module docstring), or
    None where some sequence fits no group under `token_cap`. `values` (3, n): cost, attention and
    tokens of each whole sequence (planner.py `objective_terms`); `overheads`: degree -> (n,) per-rank
    extra cost when sharded; `shares`: degree -> (degree,) attention share of each rank of a group.
    Sequences under `min_shard_tokens` stay at degree 1 where one rank has room for them."""
    cost, attention, tokens = values
    count = len(tokens)
    degrees, starts = np.ones(count, dtype=np.int64), np.zeros(count, dtype=np.int64)
    load, held = np.zeros(world_size), np.zeros(world_size)
    remaining, busiest, total = float(cost.sum()), 0.0, 0.0
    capped = token_cap != float("inf")
    cost_of, tokens_of = cost.tolist(), tokens.tolist()
    for i in np.argsort(-cost, kind="stable").tolist():
        remaining -= cost_of[i]
        # Degree 1: the least-loaded rank with room (the hot path: no per-degree arrays).
        free = np.where(held + tokens_of[i] <= token_cap * (1 + TIE), load, np.inf) if capped else load
        rank = int(np.argmin(free))
        floor = max(busiest, (total + cost_of[i] + remaining) / world_size)
        least = float(free[rank])
        best = None if least == np.inf else (max(floor, least + cost_of[i]), 1, rank, cost_of[i])
        # Sharding adds overheads to the mean and cannot lower the busiest rank below its current
        # value: where degree 1 raises neither, it wins every tie (smaller degree first).
        shardable = tokens_of[i] >= min_shard_tokens or best is None
        if (best is None or best[0] > floor) and len(allowed) > 1 and shardable:
            wider = _best_placement(i, allowed[1:], values, overheads, shares, load, held, token_cap, busiest,
                                    total + remaining)
            best = wider if best is None or (wider is not None and wider[0] < best[0] * (1 - TIE)) else best
        if best is None:
            return None
        _, degree, start, added = best
        degrees[i], starts[i] = degree, start
        load[start:start + degree] += added
        held[start:start + degree] += tokens_of[i] / degree
        total += float(np.sum(added)) if degree > 1 else added
        busiest = max(busiest, float(load[start:start + degree].max()) if degree > 1 else float(load[start]))
    return degrees, starts


def _best_placement(i: int, options: tuple[int, ...], values: np.ndarray, overheads, shares, load: np.ndarray,
                    held: np.ndarray, token_cap: float, busiest: float, others: float):
    """(score, degree, first rank, per-rank added cost) of sequence i's best placement among
    `options` degrees, or None where no group has room for its tokens. `others`: the cost of every
    other sequence, placed or not (with the overheads of those placed)."""
    cost, attention, tokens = values[0, i], values[1, i], values[2, i]
    best = None
    for degree in options:
        share = shares.get(degree, np.full(degree, 1.0 / degree))
        added = (cost - attention) / degree + attention * share + (overheads[degree][i] if degree in overheads else 0.0)
        fits = held.reshape(-1, degree).max(axis=1) + tokens / degree <= token_cap * (1 + TIE)
        if not fits.any():
            continue
        group_max = np.where(fits, (load.reshape(-1, degree) + added).max(axis=1), np.inf)
        group = int(np.argmin(group_max))
        mean = (others + float(added.sum())) / len(load)
        score = max(busiest, float(group_max[group]), mean)
        if best is None or score < best[0] * (1 - TIE):
            best = (score, degree, group * degree, added)
    return best


def fixed_sp_time_floor(tokens: np.ndarray, degree: int, world_size: int, cost: CostModel,
                        limits: PackingLimits, groups: np.ndarray | None = None) -> float:
    """A lower bound on the modelled step time of fixed SP at `degree` (sequence i on group
    `groups[i]`; None: any grouping). The busiest rank does at least what a group's most-loaded
    rank (largest head share) computes — attention × that share, linear ÷ d, one floor per
    attention call, where a group has at least one pack per long sequence and ⌈short tokens ÷
    H_pack⌉ of short ones (at degree 1, one call for all of a rank's packs: sp/layout.py) — for the
    busiest group, or over any grouping the mean over groups (packs summed: at least ⌈all short
    tokens ÷ H_pack⌉). Exposed all-to-all and c_linear (≥ 0) are left out."""
    (a, b, c), (s, _) = cost.step.attention_fit, cost.step.linear_fit
    share = max(heads_per_rank(cost.num_heads, cost.num_kv_heads, degree)) / cost.num_heads
    long = tokens >= limits.h_pack
    attention = a * tokens * tokens + b * tokens
    num_groups = world_size // degree
    if groups is None:
        packs = int(long.sum()) + int(np.ceil(float(tokens[~long].sum()) / limits.H_pack))
        few_calls = min(packs, num_groups) if degree == 1 else packs
        return cost.step.num_layers * (share * float(attention.sum()) / num_groups + c * few_calls / num_groups
                                       + s * float(tokens.sum()) / world_size)
    sums = [np.bincount(groups, weights=w, minlength=num_groups) for w in (attention, tokens, long * 1.0,
                                                                            np.where(long, 0.0, tokens))]
    calls = sums[2] + np.ceil(sums[3] / limits.H_pack)
    if degree == 1:
        calls = np.minimum(calls, 1.0)
    work = share * sums[0] + s * sums[1] / degree + c * calls
    return cost.step.num_layers * float(work.max())


def layout_step_time(tokens: list[int], degrees: np.ndarray, starts: np.ndarray, world_size: int,
                     limits: PackingLimits, cost: CostModel, overlap: bool = True, packed: list | None = None):
    """`plan_step_time(build_plan(...))` of a layout (same packs, same HSF order, same figures:
    token sums are integers, exact in float64) from the packs' token sums alone. `packed`: the
    layout's `packed_groups`, if already computed."""
    members: list[Any] = []
    pack_of: list[Any] = []
    degree: list[Any] = []
    first: list[Any] = []
    for group_degree, start, pack_members in packed or packed_groups(degrees, starts, tokens, limits):
        pack_of += [len(degree)] * len(pack_members)
        members += pack_members
        degree.append(group_degree)
        first.append(start)
    lengths = np.asarray(tokens, dtype=float)[members]
    sum_l = np.bincount(pack_of, weights=lengths, minlength=len(degree))
    sum_l2 = np.bincount(pack_of, weights=lengths * lengths, minlength=len(degree))
    packs = (sum_l, sum_l2, np.array(degree, dtype=np.int64), np.array(first, dtype=np.int64))
    return hsf_packs_step_time(packs, world_size, cost.step, cost.num_heads, cost.num_kv_heads,
                               cost.shapes.head_dim, overlap)


def packed_groups(degrees: np.ndarray, starts: np.ndarray, tokens: list[int], limits: PackingLimits):
    """(degree, first rank, sequence indices) of every pack in HSF order: groups widest first, then
    by first rank, members in index order; inside a group the packs of `pack_group` in its order."""
    degrees, starts = np.asarray(degrees, dtype=np.int64), np.asarray(starts, dtype=np.int64)
    order = np.lexsort((starts, -degrees))  # stable: equal keys keep index order
    if not len(order):
        return
    new = np.flatnonzero((np.diff(degrees[order]) != 0) | (np.diff(starts[order]) != 0)) + 1
    bounds = [0, *new.tolist(), len(order)]
    order_list, first_of = order.tolist(), order[bounds[:-1]]
    for lo, hi, degree, start in zip(bounds, bounds[1:], degrees[first_of].tolist(), starts[first_of].tolist()):
        for pack_members in pack_group(order_list[lo:hi], tokens, limits):
            yield degree, start, pack_members


