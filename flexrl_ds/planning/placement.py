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
raising the busiest block's cost. `split_block` (split.py) does (2) by recursive halving.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from flexrl_ds.planning.metrics import partition_bound
from flexrl_ds.planning.split import SLACK, CapacityError, Items, split_block  # noqa: F401  (re-exported)

ATTENTION_SHARE_2D = 0.02
"""In the 2-D block LPT, sequences above this share of a block's mean attention are placed 2-D."""
SWAP_BLOCKS = 8
"""Block refinement looks for swap partners on this many least-loaded blocks (keeps a step O(n))."""
FIX_SAMPLE = 192
"""Block refinement considers at most this many givers and takers per step (evenly sampled)."""
EXCHANGE_STEPS = 8
"""Upper bound on the rounds of attention exchanges after the block partition (~5 ms a round)."""
EXCHANGE_GAP = 0.01
"""Exchanges run only where the busiest block's attention is this far above max(goal, bound)."""
PAIR_GIVERS = 8
"""Attention exchanges consider at most this many items of the busiest block (evenly sampled) ..."""
PAIR_TAKERS = 8
"""... and this many of every other block (all their pairs are tried: keeps a step small)."""


def lpt_groups(costs: np.ndarray, num_groups: int) -> np.ndarray:
    """Group of each item: longest-processing-time first onto the least-loaded group (ties: the
    lower group; entries are distinct, so replacing the heap's top is popping then pushing)."""
    heap = [(0.0, g) for g in range(num_groups)]
    group = [0] * len(costs)
    values = np.asarray(costs).tolist()
    for i in np.argsort(-costs, kind="stable").tolist():
        load, g = heap[0]
        group[i] = g
        heapq.heapreplace(heap, (load + values[i], g))
    return np.array(group, dtype=np.int64)


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
        best: tuple[Any, Any] = (peak * (1 - SLACK), None)
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


def _sample(side: np.ndarray, limit: int = FIX_SAMPLE) -> np.ndarray:
    if len(side) <= limit:
        return side
    return side[np.linspace(0, len(side) - 1, limit).astype(np.int64)]
