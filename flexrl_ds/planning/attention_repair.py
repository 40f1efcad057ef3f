"""Attention repair of a p-block partition: trade a bounded amount of cost balance for attention.
Pure (numpy only).

After `placement.partition_blocks` every p-block's cost sits within ~0.1 % of the busiest one. Where
a few blocks must hold two long videos each (image-heavy 256 sequences on 128 ranks), their
attention stays above the goal: at equal cost, a block can only lower its attention by swapping
a longer item for shorter ones (cost L² + c·L is more linear, less quadratic, for short L), and
at a 0.1 % cost tolerance there is too little room to do that.

`repair_attention` runs only where attention is above the goal (the planner also requires the
partition's attention bound to be below it, so it is reachable in principle). A round takes every
block above the goal (*hot*, most attention first) and tries, for each of its items and every other
block (the *partner*), a **one-for-many exchange**: the hot item goes to the partner, which gives
back its shortest items — the least attention per unit of cost — the fewest whose cost keeps both
blocks under a cost ceiling (zero items: a plain move; one: a swap). Each hot block applies the
exchange lowering its attention most with both blocks' new attention below its old one; a block
takes part in at most one exchange per round. Rounds repeat until the busiest block's attention is
within the goal or no exchange lowers a hot block. The ceiling is raised in stages (a quarter,
half, all of `cost_slack` above the busiest block's cost), so cost balance is spent only as far as
attention needs; where the goal stays out of reach, a stage is kept only if attention dropped at
least MIN_TRADE × as much as cost rose (relative), else the partition is restored. A round is one
vectorised search over (hot item × partner): each block's items sorted by cost with prefix sums,
the number of items found by comparing the prefix sums with the cost needed.
"""

from __future__ import annotations

import numpy as np

CEILING_STAGES = (0.25, 0.5, 1.0)
"""Fractions of the cost slack tried in turn as the ceiling above the busiest block's cost."""
MIN_TRADE = 2.0
"""Where the goal is out of reach, cost balance (the step's time) is spent only where the
relative attention drop is at least this × the relative rise of the busiest block's cost."""
SLACK = 1e-9
"""Relative margin an exchange must lower attention by (float rounding)."""


def repair_attention(values: np.ndarray, blocks: np.ndarray, num_blocks: int, token_room: float,
                     cost_slack: float, goal: float, steps: int) -> int:
    """Lower the largest block attention to `goal` (absolute, block level) by one-for-many
    exchanges (module doc), in place on `blocks`. `values` is (3, n): cost, attention, tokens.
    Every block's cost stays ≤ (1 + cost_slack) × the busiest block's cost before the repair, its
    tokens ≤ `token_room`; the largest block attention never rises. Where the goal is not reached,
    the stage kept is the one with least attention among those whose relative attention drop is
    at least MIN_TRADE × their relative rise in busiest-block cost (the start always qualifies).
    At most `steps` exchanges; returns how many lead to the assignment kept."""
    start = _peaks(values, blocks, num_blocks)
    kept = (start[1], blocks.copy(), 0)
    done = 0
    for fraction in CEILING_STAGES:
        ceilings = np.array([start[0] * (1 + fraction * cost_slack), np.inf, token_room])
        while done < steps:
            made = _exchange_round(values, blocks, num_blocks, ceilings, goal, steps - done)
            if not made:
                break
            done += made
        cost_peak, attention_peak = _peaks(values, blocks, num_blocks)
        if attention_peak <= goal:
            return done
        drop, rise = 1 - attention_peak / start[1], cost_peak / start[0] - 1
        if drop >= MIN_TRADE * rise and attention_peak < kept[0]:
            kept = (attention_peak, blocks.copy(), done)
        if done >= steps:
            break
    blocks[:] = kept[1]
    return kept[2]


def _peaks(values: np.ndarray, blocks: np.ndarray, num_blocks: int) -> tuple[float, float]:
    """(busiest block's cost, largest block attention)."""
    return tuple(float(np.bincount(blocks, weights=values[row], minlength=num_blocks).max()) for row in (0, 1))


def _exchange_round(values: np.ndarray, blocks: np.ndarray, num_blocks: int, ceilings: np.ndarray,
                    goal: float, limit: int) -> int:
    """One round: for every block above `goal` (hot; most attention first) the exchange with
    another block that lowers the hot block's attention most under `ceilings`, both blocks' new
    attention under the hot block's old one; a block takes part in at most one exchange per round
    (so the scores, computed once, stay exact). At most `limit` exchanges; returns how many."""
    sums = np.stack([np.bincount(blocks, weights=row, minlength=num_blocks) for row in values])
    hot = sums[1] > goal
    if not hot.any():
        return 0
    givers = np.nonzero(hot[blocks])[0]
    g, b = (grid.ravel() for grid in np.meshgrid(np.arange(len(givers)), np.arange(num_blocks), indexing="ij"))
    home = blocks[givers[g]]
    g, b, home = g[b != home], b[b != home], home[b != home]
    give = values[:, givers[g]]
    prefix, order = _prefix_sums(values, blocks, num_blocks)
    # Cost taken back t: cold + give − t ≤ ceiling and hot − give + t ≤ ceiling.
    low = give[0] - (ceilings[0] - sums[0, b])
    high = give[0] + (ceilings[0] - sums[0, home])
    k = np.minimum(_first_prefix_at_least(prefix[0], b, low), np.bincount(blocks, minlength=num_blocks)[b])
    taken = prefix[:, b, k]
    ok = (taken[0] >= low) & (taken[0] <= high)
    if np.isfinite(ceilings[2]):
        ok &= (sums[2, b] + give[2] - taken[2] <= ceilings[2]) & (sums[2, home] - give[2] + taken[2] <= ceilings[2])
    score = np.maximum(sums[1, home] - give[1] + taken[1], sums[1, b] + give[1] - taken[1])
    score = np.where(ok & (score < sums[1, home] * (1 - SLACK)), score, np.inf)
    used = np.zeros(num_blocks, dtype=bool)
    made = 0
    for block in sorted(np.nonzero(hot)[0].tolist(), key=lambda h: -sums[1, h]):
        candidates = np.where((home == block) & ~used[b], score, np.inf)
        best = int(np.argmin(candidates))
        if made >= limit or used[block] or candidates[best] == np.inf:
            continue
        partner = int(b[best])
        used[[block, partner]] = True
        blocks[order[partner][:int(k[best])]] = block
        blocks[givers[g[best]]] = partner
        made += 1
    return made


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
