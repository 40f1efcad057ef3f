"""Nested placement of sequences on aligned power-of-two rank blocks. Pure (numpy only).

A sequence of degree `d ≤ p` runs on an aligned block `[k·d, (k+1)·d)` and adds `cost/d`,
`attention/d` and `tokens/d` to every rank of it. Such a block lies inside exactly one aligned
`p`-block (`p` the largest allowed degree), so every plan is

1. a partition of the sequences over the `W/p` p-blocks — the busiest rank of a p-block carries at
   least the block's total ÷ p, so this partition bounds every plan (metrics.partition_bound); fixed
   SP at p reaches exactly block total ÷ p on every block; and
2. inside each p-block, a nested layout: which sequences stay at degree p, which go to one half at
   a lower degree, and so on down to single ranks.

`partition_blocks` does (1): LPT on cost over the p-blocks (token room respected; the same LPT as
fixed SP) and, when attention is not yet within its goal, a 2-D LPT; each refined by moves/swaps
off the busiest block while its cost drops, then moves/swaps lowering the busiest block's
attention while no block's cost exceeds a ceiling; where attention is still more than 1 % above
max(goal, partition bound), rounds of exchanges — one item of a block above the goal for up to
two of a block below it, the 2-for-1 swaps that move attention at equal cost — lower it without
raising the busiest block's cost. `split_block` does (2) by recursive halving under per-rank rooms
(cost, attention, tokens): on a block of `b` ranks the `k` largest shardable sequences stay at
degree `b` (the same share on every rank), the others are split over the two halves (greedy or
snake order, then move/swap repair) so that both fit the rooms left; the smallest `k` that works is
taken (exponential, then binary search), so only what balance needs is sharded. Each half recurses
with the room the degree-`b` sequences left.
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

import numpy as np

from flexrl_ds.planning.metrics import partition_bound

ATTENTION_SHARE_2D = 0.02
"""In the 2-D block LPT, sequences above this share of a block's mean attention are placed 2-D."""
SWAP_BLOCKS = 8
"""Block refinement looks for swap partners on this many least-loaded blocks (keeps a step O(n))."""
FIX_STEPS = 4
"""Move/swap steps that try to repair a greedy two-way split exceeding its rooms."""
FIX_SAMPLE = 192
"""Block refinement considers at most this many givers and takers per step (evenly sampled)."""
SNAKE_ABOVE = 64
"""Two-way splits of more items than this start from the snake order (numpy) instead of greedy."""
SMALL_REPAIR = 64
"""Two-way splits of at most this many items are repaired in plain Python (numpy overhead)."""
SLACK = 1e-9
"""Relative slack on room checks (float rounding)."""
EXCHANGE_STEPS = 8
"""Upper bound on the rounds of attention exchanges after the block partition (~5 ms a round)."""
EXCHANGE_GAP = 0.01
"""Exchanges run only where the busiest block's attention is this far above max(goal, bound)."""
PAIR_GIVERS = 8
"""Attention exchanges consider at most this many items of the busiest block (evenly sampled) ..."""
PAIR_TAKERS = 8
"""... and this many of every other block (all their pairs are tried: keeps a step small)."""


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

    def __post_init__(self) -> None:
        self.cost, self.attention, self.tokens = (row.tolist() for row in self.values)


def partition_blocks(items: Items, num_blocks: int, block_size: int, token_cap: float, steps: int,
                     cost_slack: float, attention_goal: float) -> np.ndarray:
    """Block index of every sequence (module doc). Two starts — LPT on cost (as fixed SP) and a
    2-D LPT placing attention-heavy sequences by max(cost, attention) against their mean block
    targets — each refined on cost, then on attention with block cost ≤ (1 + cost_slack) × its
    busiest block; the result with the least attention among those within `cost_slack` of the
    lowest busiest-block cost wins. Refinement stops once the busiest block is within `cost_slack`
    of the mean (cost) or within `attention_goal` × the mean (attention)."""
    token_room = block_size * token_cap
    if num_blocks == 1:
        if sum(items.tokens) > token_room:
            raise CapacityError(int(np.argmax(items.values[2])))
        return np.zeros(len(items.cost), dtype=np.int64)
    results = []
    means = items.values[:2].sum(axis=1) / num_blocks
    good_enough = (means[0] * (1 + cost_slack), means[1] * attention_goal)
    heavy = bool((items.values[1] > ATTENTION_SHARE_2D * means[1]).any())
    for two_d in (False, True) if heavy else (False,):
        blocks = _lpt_blocks(items, num_blocks, token_room, two_d)
        attn_max = float(np.bincount(blocks, weights=items.values[1], minlength=num_blocks).max())
        _improve(blocks, items.values, 0, np.array([np.inf, attn_max, token_room]), steps, num_blocks,
                 good_enough[0])
        cost_max = float(np.bincount(blocks, weights=items.values[0], minlength=num_blocks).max())
        ceilings = np.array([cost_max * (1 + cost_slack), np.inf, token_room])
        _improve(blocks, items.values, 1, ceilings, steps, num_blocks, good_enough[1])
        sums = [float(np.bincount(blocks, weights=row, minlength=num_blocks).max()) for row in items.values[:2]]
        results.append((sums[0], sums[1], blocks))
        if sums[1] <= good_enough[1]:
            break  # attention already within its goal: no 2-D start needed
    best_cost = min(r[0] for r in results)
    cost_max, attention, blocks = min((r for r in results if r[0] <= best_cost * (1 + cost_slack)),
                                      key=lambda r: r[1])
    if attention > max(good_enough[1], partition_bound(items.values[1], num_blocks)) * (1 + EXCHANGE_GAP):
        ceilings = np.array([cost_max, np.inf, token_room])  # the busiest block's cost does not rise
        _exchange_pairs(items.values, blocks, num_blocks, ceilings, EXCHANGE_STEPS, good_enough[1])
    return blocks


def _lpt_blocks(items: Items, num_blocks: int, token_room: float, two_d: bool) -> np.ndarray:
    """LPT in decreasing cost over the blocks (lazy heap on cost). With `two_d`, sequences holding
    more than ATTENTION_SHARE_2D of a block's mean attention go to the block minimising
    max(cost/mean block cost, attention/mean block attention) instead."""
    order = np.argsort(-items.values[0], kind="stable").tolist()
    blocks = np.zeros(len(order), dtype=np.int64)
    heap = [(0.0, block) for block in range(num_blocks)]
    held, cost_sum, attn_sum = [0.0] * num_blocks, [0.0] * num_blocks, [0.0] * num_blocks
    cost_scale = num_blocks / max(sum(items.cost), 1e-30)
    attn_scale = num_blocks / max(sum(items.attention), 1e-30)
    capped = token_room != float("inf")
    for item in order:
        cost, attn, tokens = items.cost[item], items.attention[item], items.tokens[item]
        if two_d and attn * attn_scale > ATTENTION_SHARE_2D:
            scores = [max((cost_sum[b] + cost) * cost_scale, (attn_sum[b] + attn) * attn_scale)
                      if not capped or held[b] + tokens <= token_room else float("inf") for b in range(num_blocks)]
            block = min(range(num_blocks), key=scores.__getitem__)
            if scores[block] == float("inf"):
                raise CapacityError(item)
        else:
            skipped = []
            while heap:
                load, block = heapq.heappop(heap)
                if load != cost_sum[block] or (capped and held[block] + tokens > token_room):
                    if load == cost_sum[block]:
                        skipped.append((load, block))
                    continue
                break
            else:
                raise CapacityError(item)
            for entry in skipped:
                heapq.heappush(heap, entry)
        blocks[item] = block
        held[block] += tokens
        cost_sum[block] += cost
        attn_sum[block] += attn
        heapq.heappush(heap, (cost_sum[block], block))
    return blocks


def _improve(blocks: np.ndarray, values: np.ndarray, dim: int, ceilings: np.ndarray, steps: int,
             num_blocks: int, good_enough: float) -> None:
    """Moves/swaps off the block where `values[dim]` peaks while that peak drops and exceeds
    `good_enough`; other dimensions' block sums stay under `ceilings` (the entry of `dim` is
    ignored). Candidates are sampled (FIX_SAMPLE per side) so a step stays cheap."""
    guard = np.arange(3) != dim
    sums = np.stack([np.bincount(blocks, weights=row, minlength=num_blocks) for row in values])
    for _ in range(steps):
        top = int(np.argmax(sums[dim]))
        peak = sums[dim, top]
        if peak <= good_enough:
            return
        givers = _sample(np.nonzero(blocks == top)[0])
        give = values[:, givers]
        best = (peak * (1 - SLACK), None)
        # Moves: one giver to another block.
        new = sums[:, None, :] + give[:, :, None]
        ok = np.all(new[guard] <= ceilings[guard, None, None], axis=0)
        ok[:, top] = False
        score = np.where(ok, np.maximum(new[dim], peak - give[dim][:, None]), np.inf)
        g, b = np.unravel_index(int(np.argmin(score)), score.shape)
        if score[g, b] < best[0]:
            best = (score[g, b], (givers[g], -1, b))
        # Swaps with a smaller item on one of the least-loaded blocks.
        light = np.argsort(sums[dim])[:SWAP_BLOCKS + 1]
        light = light[light != top][:SWAP_BLOCKS]
        is_light = np.zeros(num_blocks, dtype=bool)
        is_light[light] = True
        takers = _sample(np.nonzero(is_light[blocks])[0])
        if len(takers):
            delta = give[:, :, None] - values[:, takers][:, None, :]
            receive = sums[:, blocks[takers]][:, None, :] + delta
            home = sums[:, top][:, None, None] - delta
            ok = (delta[dim] > 0) & np.all(receive[guard] <= ceilings[guard, None, None], axis=0)
            ok &= np.all(home[guard] <= np.maximum(ceilings[guard], sums[guard, top])[:, None, None], axis=0)
            score = np.where(ok, np.maximum(receive[dim], home[dim]), np.inf)
            g, t = np.unravel_index(int(np.argmin(score)), score.shape)
            if score[g, t] < best[0]:
                best = (score[g, t], (givers[g], takers[t], int(blocks[takers[t]])))
        if best[1] is None:
            return
        give_item, take_item, target = best[1]
        sums[:, top] -= values[:, give_item]
        sums[:, target] += values[:, give_item]
        blocks[give_item] = target
        if take_item >= 0:
            sums[:, target] -= values[:, take_item]
            sums[:, top] += values[:, take_item]
            blocks[take_item] = top


def _exchange_pairs(values: np.ndarray, blocks: np.ndarray, num_blocks: int, ceilings: np.ndarray, steps: int,
                    good_enough: float) -> None:
    """Attention refinement of the blocks whose attention exceeds `good_enough` (hot): exchanges of
    one item of a hot block for up to two of a cold block (move, swap or 2-for-1 swap) keeping both
    blocks' cost and tokens under `ceilings` and lowering the larger attention of the two; per
    round, the best exchange of every hot block (busiest first, each cold block used once). At the
    cost ceiling a swap of equal cost cannot change attention (cost is monotone in length); one
    long item for two shorter ones of the same cost can. The second item is found by sorted search
    on cost (a round is O(hot × cold items)). Stops when no exchange lowers a hot block."""
    padded = np.concatenate([values, np.zeros((3, 1))], axis=1)  # column -1: "nothing"
    rows = [0, 1, 2] if np.isfinite(ceilings[2]) else [0, 1]
    for _ in range(steps):
        sums = np.stack([np.bincount(blocks, weights=row, minlength=num_blocks) for row in values])
        hot = sums[1] > good_enough
        if not hot.any() or hot.all():
            return
        give, first, second, partner = _exchange_candidates(values, blocks, sums[0], hot, ceilings[0])
        home = blocks[give]
        delta = values[rows][:, give] - padded[rows][:, first] - padded[rows][:, second]
        new_home, new_partner = sums[rows][:, home] - delta, sums[rows][:, partner] + delta
        ok = (new_home[0] <= ceilings[0]) & (new_partner[0] <= ceilings[0])
        if len(rows) == 3:
            ok &= (new_home[2] <= ceilings[2]) & (new_partner[2] <= ceilings[2])
        score = np.where(ok, np.maximum(new_home[1], new_partner[1]), np.inf)
        score[score >= sums[1, home] * (1 - SLACK)] = np.inf
        if not _apply_exchanges(blocks, sums[1], score, give, home, first, second, partner):
            return


def _exchange_candidates(values: np.ndarray, blocks: np.ndarray, block_cost: np.ndarray, hot: np.ndarray,
                         ceiling: float):
    """Flat (giver, first taken, second taken, cold block) candidates; -1 = nothing. Givers: up to
    PAIR_GIVERS items of each hot block; first taken: nothing or up to PAIR_TAKERS items of each cold
    block; second taken: nothing, or the items of that block whose cost is at or just above the low
    end and the middle of the window that keeps both blocks' cost under the ceiling."""
    hot_blocks, cold_blocks = np.nonzero(hot)[0], np.nonzero(~hot)[0]
    give = np.concatenate([_sample(np.nonzero(blocks == b)[0], PAIR_GIVERS) for b in hot_blocks])
    cold_items = np.nonzero(~hot[blocks])[0]
    firsts = np.concatenate([np.full(len(cold_blocks), -1), np.concatenate(
        [_sample(np.nonzero(blocks == b)[0], PAIR_TAKERS) for b in cold_blocks])])
    owner = np.concatenate([cold_blocks, blocks[firsts[len(cold_blocks):]]])
    cost = values[0]
    g, f = (grid.ravel() for grid in np.meshgrid(np.arange(len(give)), np.arange(len(firsts)), indexing="ij"))
    giver, first, block = give[g], firsts[f], owner[f]
    # The second item's cost c2 keeps both blocks under the ceiling: low ≤ c2 ≤ high.
    remaining = cost[giver] - np.where(first >= 0, cost[np.maximum(first, 0)], 0.0)
    low = remaining - (ceiling - block_cost[block])
    high = remaining - (block_cost[blocks[giver]] - ceiling)
    scale = 4 * float(cost.max()) + 1
    order = cold_items[np.lexsort((cost[cold_items], blocks[cold_items]))]
    keys = blocks[order] * scale + cost[order]
    picks = [np.full(len(giver), -1)]
    for target in (low, (low + high) / 2):
        near = np.searchsorted(keys, block * scale + target)
        pick = order[np.minimum(near, len(order) - 1)]
        valid = (near < len(order)) & (blocks[pick] == block) & (pick != first)
        valid &= (cost[pick] >= low) & (cost[pick] <= high)
        picks.append(np.where(valid, pick, -1))
    second = np.concatenate(picks)
    repeat = len(picks)
    return (np.tile(giver, repeat), np.tile(first, repeat), second, np.tile(block, repeat))


def _apply_exchanges(blocks, attention, score, give, home, first, second, partner) -> bool:
    """Per hot block (most attention first) its best exchange in `score` (giver × taken set) whose
    cold block is still unused this step; False when there is none."""
    done = False
    used = np.zeros(len(attention), dtype=bool)
    for block in sorted(set(home.tolist()), key=lambda b: -attention[b]):
        sub = np.where((home == block) & ~used[partner], score, np.inf)
        q = int(np.argmin(sub))
        if sub[q] == np.inf:
            continue
        used[partner[q]] = done = True
        blocks[give[q]] = partner[q]
        for taken in (first[q], second[q]):
            if taken >= 0:
                blocks[taken] = block
    return done


def split_block(items: Items, members: list[int], first: int, size: int, room: tuple[float, float, float]) -> None:
    """Place `members` (sorted by decreasing cost) on ranks [first, first+size) under per-rank
    `room` (cost, attention, tokens) by recursive halving (module doc). Soft rooms (cost,
    attention) may be exceeded when pinned sequences leave no choice; the token room is hard."""
    if not members:
        return
    if size == 1:
        items.degrees[members] = 1
        items.starts[members] = first
        return
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
    split_block(items, left, first, half, rest_room)
    split_block(items, right, first + half, half, rest_room)


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


def _attempt(items: Items, members: list[int], shardable: list[int], k: int, size: int, room):
    """(k, room left per rank, left half, right half, (cost/attn excess, 0, token excess))."""
    top = shardable[:k]
    chosen = set(top)
    rest = [i for i in members if i not in chosen] if k else members
    used = [sum(column[i] for i in top) / size for column in (items.cost, items.attention, items.tokens)]
    left_room = tuple(r - u for r, u in zip(room, used))
    half = size // 2
    left, right, excess = _bisect(items, rest, tuple(r * half for r in left_room))
    return k, left_room, left, right, excess


def _bisect(items: Items, rest: list[int], half_room: tuple[float, float, float]):
    """Greedy two-way split of `rest` (decreasing cost) minimising the larger normalised load, then
    a few repair moves/swaps. Returns (left, right, (soft excess, 0, token excess)); excess ≤ 0 fits."""
    scale = tuple(0.0 if r == float("inf") else 1.0 / max(r, 1e-30) for r in half_room)
    if len(rest) > SNAKE_ABOVE:
        return _bisect_snake(items, rest, scale)
    sc, sa, st = scale
    cost, attention, tokens = items.cost, items.attention, items.tokens
    left, right = [], []
    lc = la = lt = rc = ra = rt = 0.0
    for i in rest:
        c, a, t = cost[i], attention[i], tokens[i]
        if max((lc + c) * sc, (la + a) * sa, (lt + t) * st) <= max((rc + c) * sc, (ra + a) * sa, (rt + t) * st):
            left.append(i)
            lc, la, lt = lc + c, la + a, lt + t
        else:
            right.append(i)
            rc, ra, rt = rc + c, ra + a, rt + t
    loads = [[lc, la, lt], [rc, ra, rt]]
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
    sc, sa, st = scale  # per-dimension 1/room (0: no room limit)
    soft = max(loads[0][0] * sc, loads[0][1] * sa, loads[1][0] * sc, loads[1][1] * sa) - 1 - SLACK
    hard = max(loads[0][2], loads[1][2]) * st - 1 - SLACK if st else -1.0
    return max(soft, hard), 0.0, hard


def _repair_small(items: Items, left: list[int], right: list[int], loads, scale):
    """`_repair` for a few items in plain Python: per giver, the two takers (or a plain move) whose
    value in the most loaded dimension is nearest to evening the halves (bisect), scored on all."""
    sides = [list(left), list(right)]
    loads = [list(loads[0]), list(loads[1])]
    sc, sa, st = scale
    columns = (items.cost, items.attention, items.tokens)
    for _ in range(FIX_STEPS):
        normalised = [max(side[0] * sc, side[1] * sa, side[2] * st) for side in loads]
        current = max(normalised)
        if current <= 1 + SLACK:
            break
        heavy = 0 if normalised[0] >= normalised[1] else 1
        (hc, ha, ht), (lc, la, lt) = loads[heavy], loads[1 - heavy]
        dim = max(range(3), key=lambda k: loads[heavy][k] * scale[k])
        key = columns[dim]
        takers = sorted([(0.0, -1)] + [(key[j], j) for j in sides[1 - heavy]])
        values = [v for v, _ in takers]
        half_gap = (loads[heavy][dim] - loads[1 - heavy][dim]) / 2
        best, choice = current * (1 - SLACK), None
        for i in sides[heavy]:
            spot = bisect.bisect_left(values, key[i] - half_gap)
            for position in (spot - 1, spot):
                if not 0 <= position < len(takers):
                    continue
                j = takers[position][1]
                dc = items.cost[i] - (items.cost[j] if j >= 0 else 0.0)
                da = items.attention[i] - (items.attention[j] if j >= 0 else 0.0)
                dt = items.tokens[i] - (items.tokens[j] if j >= 0 else 0.0)
                score = max((hc - dc) * sc, (ha - da) * sa, (ht - dt) * st,
                            (lc + dc) * sc, (la + da) * sa, (lt + dt) * st)
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
    scale_vec = np.asarray(scale)
    loads = np.array(loads)
    sides = [np.array(left, dtype=np.int64), np.array(right, dtype=np.int64)]
    for _ in range(FIX_STEPS):
        normalised = loads * scale_vec
        current = float(normalised.max())
        if current <= 1 + SLACK:
            break
        heavy = int(np.argmax(normalised.max(axis=1)))
        light = 1 - heavy
        dim = int(np.argmax(normalised[heavy]))
        give, take = sides[heavy], sides[light]
        take_values = np.concatenate([[0.0], items.values[dim, take]])  # 0: a plain move
        sorted_at = np.argsort(take_values, kind="stable")
        wanted = items.values[dim, give] - (loads[heavy, dim] - loads[light, dim]) / 2
        spot = np.searchsorted(take_values[sorted_at], wanted)
        pairs_give = np.concatenate([np.arange(len(give))] * 2)
        pairs_take = sorted_at[np.clip(np.concatenate([spot - 1, spot]), 0, len(take_values) - 1)]
        taken = np.concatenate([np.zeros((3, 1)), items.values[:, take]], axis=1)[:, pairs_take]
        delta = items.values[:, give[pairs_give]] - taken
        score = np.maximum(((loads[heavy][:, None] - delta) * scale_vec[:, None]).max(axis=0),
                           ((loads[light][:, None] + delta) * scale_vec[:, None]).max(axis=0))
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


def _sample(side: np.ndarray, limit: int = FIX_SAMPLE) -> np.ndarray:
    if len(side) <= limit:
        return side
    return side[np.linspace(0, len(side) - 1, limit).astype(np.int64)]
