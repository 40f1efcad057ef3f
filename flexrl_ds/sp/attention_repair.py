"""Attention repair of a p-block partition: trade a bounded amount of cost balance for attention.
Pure (numpy only).

After `placement.partition_blocks` every p-block's cost sits within ~0.1 % of the busiest one. Where
a few blocks must hold two long videos each (image-heavy 256 sequences on 128 ranks), their
attention stays above the goal: at equal cost, a block can only lower its attention by swapping
a longer item for shorter ones (cost L² + c·L is more linear, less quadratic, for short L), and
at a 0.1 % cost tolerance there is too little room to do that.

`repair_attention` runs only where attention is above the goal (and the goal is above the
partition's attention bound, so it is reachable in principle). Each step takes the block with most
attention (the *hot* block) and tries, for each of its items and every other block (the
*partner*), a **one-for-many exchange**: the hot item goes to the partner, which gives back its
shortest items — the least attention per unit of cost — the fewest whose cost keeps both blocks
under a cost ceiling (zero items: a plain move; one: a swap). The exchange lowering the larger of
the two blocks' attention most is applied; the step is repeated until the busiest block's
attention is within the goal or no exchange lowers it. The ceiling is raised in stages (a quarter,
half, all of `cost_slack` above the busiest block's cost), so cost balance is spent only as far
as attention needs. A step is one vectorised search over (hot item × partner): the partner's
items sorted by cost with prefix sums, the number of items found by sorted search.
"""

from __future__ import annotations

import numpy as np

CEILING_STAGES = (0.25, 0.5, 1.0)
"""Fractions of the cost slack tried in turn as the ceiling above the busiest block's cost."""
SLACK = 1e-9
"""Relative margin an exchange must lower attention by (float rounding)."""


def repair_attention(values: np.ndarray, blocks: np.ndarray, num_blocks: int, token_room: float,
                     cost_slack: float, goal: float, steps: int) -> int:
    """Lower the largest block attention to `goal` (absolute, block level) by one-for-many
    exchanges (module doc), in place on `blocks`. `values` is (3, n): cost, attention, tokens.
    Every block's cost stays ≤ (1 + cost_slack) × the busiest block's cost before the repair, its
    tokens ≤ `token_room`; the largest block attention never rises. Returns the exchanges made."""
    busiest_cost = float(np.bincount(blocks, weights=values[0], minlength=num_blocks).max())
    done = 0
    for fraction in CEILING_STAGES:
        ceilings = np.array([busiest_cost * (1 + fraction * cost_slack), np.inf, token_room])
        while done < steps:
            exchange = _best_exchange(values, blocks, num_blocks, ceilings, goal)
            if exchange is None:
                break
            giver, partner, taken = exchange
            blocks[taken] = blocks[giver]
            blocks[giver] = partner
            done += 1
        else:
            return done
        if _block_sums(values[1], blocks, num_blocks).max() <= goal:
            return done
    return done


def _block_sums(row: np.ndarray, blocks: np.ndarray, num_blocks: int) -> np.ndarray:
    return np.bincount(blocks, weights=row, minlength=num_blocks)


def _best_exchange(values: np.ndarray, blocks: np.ndarray, num_blocks: int, ceilings: np.ndarray,
                   goal: float):
    """(giver item, partner block, items taken back) of the exchange that lowers the busiest
    block's attention most under `ceilings`; None when it is within `goal` or nothing lowers it."""
    sums = np.stack([_block_sums(row, blocks, num_blocks) for row in values])
    hot = int(np.argmax(sums[1]))
    if sums[1, hot] <= goal:
        return None
    givers = np.nonzero(blocks == hot)[0]
    prefix, order = _prefix_sums(values, blocks, num_blocks)
    counts = np.bincount(blocks, minlength=num_blocks)
    partners = np.arange(num_blocks)
    g, b = (grid.ravel() for grid in np.meshgrid(np.arange(len(givers)), partners, indexing="ij"))
    keep = b != hot
    g, b = g[keep], b[keep]
    give = values[:, givers[g]]
    # Cost taken back t: partner + give − t ≤ ceiling and hot − give + t ≤ ceiling.
    low = give[0] - (ceilings[0] - sums[0, b])
    high = give[0] + (ceilings[0] - sums[0, hot])
    k = _first_prefix_at_least(prefix[0], b, low)
    k = np.minimum(k, counts[b])
    taken = prefix[:, b, k]
    ok = (taken[0] >= low) & (taken[0] <= high)
    if np.isfinite(ceilings[2]):
        ok &= (sums[2, b] + give[2] - taken[2] <= ceilings[2]) & (sums[2, hot] - give[2] + taken[2] <= ceilings[2])
    score = np.maximum(sums[1, hot] - give[1] + taken[1], sums[1, b] + give[1] - taken[1])
    score = np.where(ok, score, np.inf)
    best = int(np.argmin(score))
    if not score[best] < sums[1, hot] * (1 - SLACK):
        return None
    partner = int(b[best])
    return int(givers[g[best]]), partner, order[partner][:int(k[best])]


def _prefix_sums(values: np.ndarray, blocks: np.ndarray, num_blocks: int):
    """((3, num_blocks, max items + 1) prefix sums of each block's items in increasing cost,
    padded with the block total; per block, its items in that order)."""
    ranked = np.lexsort((values[0], blocks))
    counts = np.bincount(blocks, minlength=num_blocks)
    starts = np.concatenate([[0], np.cumsum(counts)])
    position = np.arange(len(ranked)) - np.repeat(starts[:-1], counts)
    running = np.cumsum(values[:, ranked], axis=1)
    running -= np.concatenate([np.zeros((3, 1)), running], axis=1)[:, np.repeat(starts[:-1], counts)]
    prefix = np.zeros((3, num_blocks, int(counts.max()) + 1))
    prefix[:, blocks[ranked], position + 1] = running
    filled = np.arange(prefix.shape[2])[None, :] <= counts[:, None]
    prefix = np.where(filled, prefix, np.take_along_axis(prefix, counts[None, :, None].repeat(3, 0), axis=2))
    return prefix, [ranked[starts[b]:starts[b + 1]] for b in range(num_blocks)]


def _first_prefix_at_least(prefix_cost: np.ndarray, rows: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Per (row, target): the smallest k with prefix_cost[row, k] ≥ target (width − 1 if none)."""
    width = prefix_cost.shape[1]
    hits = prefix_cost[rows] >= targets[:, None]
    return np.where(hits.any(axis=1), np.argmax(hits, axis=1), width - 1)
