"""Recursive halving of one aligned p-block under per-rank rooms. Pure (numpy only).

`split_block` places the sequences of one p-block (placement.py partitions them over the
p-blocks): on a block of `b` ranks the `k` largest shardable sequences stay at degree `b`, the
others are split over the two halves (greedy or snake order, then move/swap repair) so that both
fit the rooms left; the smallest `k` that works is taken (exponential, then binary search), so only
what balance needs is sharded. Each half recurses with the room the degree-`b` sequences left.

Rooms are per rank (head-aware placement): a degree-`b` sequence takes from rank i of its group
the linear part ÷ b, the attention × that rank's query-head share (`Items.shares`: 28 heads at
b = 8 → 4/28 or 3/28, not 1/8) and `Items.overhead` (per-rank cost a sequence pays only when
sharded: the exposed all-to-all and the per-pack attention floor; 0 without a calibration). A half
is split by the sum of its ranks' rooms, so ranks holding fewer heads of the long sequences take
more of the short ones.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FIX_STEPS = 4
"""Move/swap steps that try to repair a greedy two-way split exceeding its rooms."""
SNAKE_ABOVE = 64
"""Two-way splits of more items than this start from the snake order (numpy) instead of greedy."""
SMALL_REPAIR = 64
"""Two-way splits of at most this many items are repaired in plain Python (numpy overhead)."""
SLACK = 1e-9
"""Relative slack on room checks (float rounding)."""


class CapacityError(ValueError):
    """No block can take a sequence under the per-rank token cap (args[0]: the sequence index)."""


@dataclass
class Items:
    """Per-sequence quantities (indexed by sequence) and the placement being built."""

    values: np.ndarray
    """(3, n): cost L² + c·L, attention L², tokens L of each whole sequence."""
    pinned: np.ndarray
    """(n,) bool: sequence kept at degree 1 unless the token cap needs more."""
    degrees: np.ndarray
    """(n,) degree chosen for each sequence."""
    starts: np.ndarray
    """(n,) first rank of each sequence's block."""
    shares: dict[int, np.ndarray] = field(default_factory=dict)
    """degree -> (degree,) share of a sequence's attention each rank of such a group does (its query
    heads ÷ all, planning/heads.py); a degree not listed: 1/degree each (an even split)."""
    overhead: dict[int, np.ndarray] = field(default_factory=dict)
    """degree -> (n,) extra cost per rank of each sequence at that degree (exposed all-to-all,
    per-pack floor; same units as `values[0]`); a degree not listed: none."""

    def __post_init__(self) -> None:
        self.cost, self.attention, self.tokens = (row.tolist() for row in self.values)

    def busiest_share(self, degree: int) -> float:
        """The largest attention share of one rank of a degree-`degree` group."""
        return float(self.shares[degree].max()) if degree in self.shares else 1.0 / degree


def split_block(items: Items, members: list[int], first: int, size: int, room) -> None:
    """Place `members` (sorted by decreasing cost) on ranks [first, first+size) under per-rank
    `room` (cost, attention, tokens: 3 numbers, or a (3, size) array of per-rank rooms) by recursive
    halving (module doc). Soft rooms (cost, attention) may be exceeded when pinned sequences leave
    no choice; the token room is hard."""
    if not members:
        return
    if size == 1:
        items.degrees[members] = 1
        items.starts[members] = first
        return
    room = np.asarray(room, dtype=float)
    room = np.repeat(room[:, None], size, axis=1) if room.ndim == 1 else room
    shardable = [i for i in members if not items.pinned[i]]
    attempt = _search_k(items, members, shardable, size, room)
    if attempt[4][2] > 0 and any(items.pinned[i] for i in members):
        # The token cap is hard: release pinned sequences (degree `size` for all always fits).
        shardable = list(members)
        attempt = _search_k(items, members, shardable, size, room)
    k, rest_room, left, right, _ = attempt
    top = shardable[:k]
    items.degrees[top] = size
    items.starts[top] = first
    half = size // 2
    split_block(items, left, first, half, rest_room[:, :half])
    split_block(items, right, first + half, half, rest_room[:, half:])


def _search_k(items: Items, members: list[int], shardable: list[int], size: int, room):
    """Smallest k (exponential, then binary search) whose split fits; else the least-excess try."""
    tried: dict[int, tuple] = {}

    def run(k: int):
        if k not in tried:
            tried[k] = _attempt(items, members, shardable, k, size, room)
        return tried[k]

    fits = lambda result: max(result[4]) <= 0  # noqa: E731
    if fits(run(0)):
        return tried[0]
    low, high = 0, None
    k = 1
    while k < len(shardable):
        if fits(run(k)):
            high = k
            break
        low, k = k, 2 * k
    if high is None:
        if not fits(run(len(shardable))):
            return min(tried.values(), key=lambda r: (r[4][2] > 0, max(r[4]), r[0]))
        high = len(shardable)
    while high - low > 1:
        middle = (low + high) // 2
        if fits(run(middle)):
            high = middle
        else:
            low = middle
    return tried[high]


def _attempt(items: Items, members: list[int], shardable: list[int], k: int, size: int, room: np.ndarray):
    """(k, per-rank room left (3, size), left half, right half, (cost/attn excess, 0, token excess))."""
    top = shardable[:k]
    chosen = set(top)
    rest = [i for i in members if i not in chosen] if k else members
    rest_room = room - used_per_rank(items, top, size)
    half = size // 2
    left, right, excess = _bisect(items, rest, rest_room[:, :half].sum(axis=1), rest_room[:, half:].sum(axis=1))
    return k, rest_room, left, right, excess


def used_per_rank(items: Items, top: list[int], size: int) -> np.ndarray:
    """(3, size): cost, attention and tokens each rank of a degree-`size` group does for `top`."""
    if not top:
        return np.zeros((3, size))
    share = items.shares.get(size, np.full(size, 1.0 / size))
    attention = sum(items.attention[i] for i in top)
    linear = sum(items.cost[i] for i in top) - attention
    extra = float(items.overhead[size][top].sum()) if size in items.overhead else 0.0
    return np.stack([linear / size + attention * share + extra, attention * share,
                     np.full(size, sum(items.tokens[i] for i in top) / size)])


def rank_costs(items: Items, members, first: int, size: int) -> np.ndarray:
    """(size,) cost of each rank of [first, first+size) under the placement of `members` in `items`
    (head-aware attention, linear ÷ d, overheads): what `used_per_rank` charged."""
    members = np.asarray(members, dtype=np.int64)
    out = np.zeros(size)
    degrees, starts = items.degrees[members], items.starts[members] - first
    attention = items.values[1, members]
    linear = items.values[0, members] - attention
    for degree in np.unique(degrees).tolist():
        on = degrees == degree
        share = items.shares.get(degree, np.full(degree, 1.0 / degree))
        extra = items.overhead[degree][members[on]] if degree in items.overhead else 0.0
        for offset in range(degree):
            np.add.at(out, starts[on] + offset, linear[on] / degree + attention[on] * share[offset] + extra)
    return out


def _scales(*rooms) -> np.ndarray:
    """(2, 3): 1/room of each half per dimension (0: no limit)."""
    return np.array([[0.0 if r == float("inf") else 1.0 / max(r, 1e-30) for r in room] for room in rooms])


def _bisect(items: Items, rest: list[int], left_room, right_room):
    """Greedy two-way split of `rest` (decreasing cost) minimising the larger normalised load, then
    a few repair moves/swaps. Returns (left, right, (soft excess, 0, token excess)); excess ≤ 0 fits."""
    scale = _scales(left_room, right_room)
    if len(rest) > SNAKE_ABOVE:
        return _bisect_snake(items, rest, scale)
    (lsc, lsa, lst), (rsc, rsa, rst) = scale.tolist()
    cost, attention, tokens = items.cost, items.attention, items.tokens
    left, right = [], []
    lc = la = lt = rc = ra = rt = 0.0
    for i in rest:
        c, a, t = cost[i], attention[i], tokens[i]
        # max(left's three normalised loads) <= max(right's), written out (the hot loop of planning)
        to_left, to_right = (lc + c) * lsc, (rc + c) * rsc
        x, y = (la + a) * lsa, (ra + a) * rsa
        to_left, to_right = (x if x > to_left else to_left), (y if y > to_right else to_right)
        x, y = (lt + t) * lst, (rt + t) * rst
        if (x if x > to_left else to_left) <= (y if y > to_right else to_right):
            left.append(i)
            lc, la, lt = lc + c, la + a, lt + t
        else:
            right.append(i)
            rc, ra, rt = rc + c, ra + a, rt + t
    loads: Any = [[lc, la, lt], [rc, ra, rt]]
    if _excess(loads, scale)[0] > 0 and len(rest) > 1:
        repair = _repair_small if len(rest) <= SMALL_REPAIR else _repair
        left, right, loads = repair(items, left, right, loads, scale)
    return left, right, _excess(loads, scale)


def _bisect_snake(items: Items, rest: list[int], scale):
    """Many items: snake order (L R R L L R R L …, in decreasing cost; each half within one item of
    the other) as one numpy step, then the sorted-search repair."""
    index = np.asarray(rest, dtype=np.int64)
    to_left = (np.arange(len(index)) + 1) % 4 < 2
    loads = np.stack([items.values[:, index[to_left]].sum(axis=1), items.values[:, index[~to_left]].sum(axis=1)])
    left, right = index[to_left].tolist(), index[~to_left].tolist()
    if _excess(loads.tolist(), scale)[0] > 0:
        left, right, loads = _repair(items, left, right, loads, scale)
    return left, right, _excess(loads if isinstance(loads, list) else loads.tolist(), scale)


def _excess(loads, scale) -> tuple[float, float, float]:
    """(max excess, 0, token excess) of two halves' loads ÷ rooms (plain floats: 2 × 3 values)."""
    (lc, la, lt), (rc, ra, rt) = (loads.tolist() if isinstance(loads, np.ndarray) else loads)
    (sc, sa, st), (tc, ta, tt) = scale.tolist()
    soft = max(lc * sc, la * sa, rc * tc, ra * ta) - 1 - SLACK
    hard = max(lt * st, rt * tt) - 1 - SLACK if (st != 0 or tt != 0) else -1.0
    return max(soft, hard), 0.0, hard


def _even_delta(heavy_load: float, light_load: float, heavy_scale: float, light_scale: float) -> float:
    """The amount moved from the heavy half to the light one that leaves both equally full."""
    return (heavy_load * heavy_scale - light_load * light_scale) / max(heavy_scale + light_scale, 1e-300)


def _repair_small(items: Items, left: list[int], right: list[int], loads, scale):
    """`_repair` for a few items in plain Python: per giver, the two takers (or a plain move) whose
    value in the most loaded dimension is nearest to evening the halves (bisect), scored on all."""
    sides = [list(left), list(right)]
    loads = [list(loads[0]), list(loads[1])]
    scales = scale.tolist()
    columns = (items.cost, items.attention, items.tokens)
    for _ in range(FIX_STEPS):
        normalised = [max(v * f for v, f in zip(side, s)) for side, s in zip(loads, scales)]
        current = max(normalised)
        if current <= 1 + SLACK:
            break
        heavy = 0 if normalised[0] >= normalised[1] else 1
        hs, ls = scales[heavy], scales[1 - heavy]
        (hc, ha, ht), (lc, la, lt) = loads[heavy], loads[1 - heavy]
        dim = max(range(3), key=lambda k: loads[heavy][k] * hs[k])
        key = columns[dim]
        takers = sorted([(0.0, -1)] + [(key[j], j) for j in sides[1 - heavy]])
        values = [v for v, _ in takers]
        gap = _even_delta(loads[heavy][dim], loads[1 - heavy][dim], hs[dim], ls[dim])
        best, choice = current * (1 - SLACK), None
        for i in sides[heavy]:
            spot = bisect.bisect_left(values, key[i] - gap)
            for position in (spot - 1, spot):
                if not 0 <= position < len(takers):
                    continue
                j = takers[position][1]
                dc = items.cost[i] - (items.cost[j] if j >= 0 else 0.0)
                da = items.attention[i] - (items.attention[j] if j >= 0 else 0.0)
                dt = items.tokens[i] - (items.tokens[j] if j >= 0 else 0.0)
                score = max((hc - dc) * hs[0], (ha - da) * hs[1], (ht - dt) * hs[2],
                            (lc + dc) * ls[0], (la + da) * ls[1], (lt + dt) * ls[2])
                if score < best:
                    best, choice = score, (i, j, dc, da, dt)
        if choice is None:
            break
        i, j, dc, da, dt = choice
        sides[heavy].remove(i)
        sides[1 - heavy].append(i)
        if j >= 0:
            sides[1 - heavy].remove(j)
            sides[heavy].append(j)
        loads[heavy] = [hc - dc, ha - da, ht - dt]
        loads[1 - heavy] = [lc + dc, la + da, lt + dt]
    cost = items.cost
    return sorted(sides[0], key=lambda i: -cost[i]), sorted(sides[1], key=lambda i: -cost[i]), loads


def _repair(items: Items, left: list[int], right: list[int], loads: np.ndarray, scale):
    """Moves/swaps between the halves while the larger normalised load drops. Per step, in the most
    loaded dimension, each giver is paired with the takers whose value is nearest to leaving both
    halves even (sorted search, O(n log n)); all dimensions then score those pairs."""
    loads = np.array(loads)
    sides = [np.array(left, dtype=np.int64), np.array(right, dtype=np.int64)]
    for _ in range(FIX_STEPS):
        normalised = loads * scale
        current = float(normalised.max())
        if current <= 1 + SLACK:
            break
        heavy = int(np.argmax(normalised.max(axis=1)))
        light = 1 - heavy
        dim = int(np.argmax(normalised[heavy]))
        give, take = sides[heavy], sides[light]
        take_values = np.concatenate([[0.0], items.values[dim, take]])  # 0: a plain move
        sorted_at = np.argsort(take_values, kind="stable")
        gap = _even_delta(loads[heavy, dim], loads[light, dim], scale[heavy, dim], scale[light, dim])
        spot = np.searchsorted(take_values[sorted_at], items.values[dim, give] - gap)
        pairs_give = np.concatenate([np.arange(len(give))] * 2)
        pairs_take = sorted_at[np.clip(np.concatenate([spot - 1, spot]), 0, len(take_values) - 1)]
        taken = np.concatenate([np.zeros((3, 1)), items.values[:, take]], axis=1)[:, pairs_take]
        delta = items.values[:, give[pairs_give]] - taken
        score = np.maximum(((loads[heavy][:, None] - delta) * scale[heavy][:, None]).max(axis=0),
                           ((loads[light][:, None] + delta) * scale[light][:, None]).max(axis=0))
        best = int(np.argmin(score))
        if score[best] >= current * (1 - SLACK):
            break
        moved, back = int(give[pairs_give[best]]), int(pairs_take[best]) - 1
        back = int(take[back]) if back >= 0 else -1
        sides[heavy] = sides[heavy][sides[heavy] != moved]
        sides[light] = np.append(sides[light], moved)
        loads[heavy] -= items.values[:, moved]
        loads[light] += items.values[:, moved]
        if back >= 0:
            sides[light] = sides[light][sides[light] != back]
            sides[heavy] = np.append(sides[heavy], back)
            loads[light] -= items.values[:, back]
            loads[heavy] += items.values[:, back]
    order = items.values[0]
    return (sorted(sides[0].tolist(), key=lambda i: -order[i]),
            sorted(sides[1].tolist(), key=lambda i: -order[i]), loads.tolist())
