"""Attention-first search for a p-block partition: the fallback where the attention repair leaves a
block above the goal. Pure (numpy only).

Where each p-block holds only a few sequences (image-heavy 64 sequences on 16 blocks: 24 long
videos, so 8 blocks must hold two of them), the cost-first partition and its exchanges
(`placement.partition_blocks`, `attention_repair.repair_attention`) stay stuck a few % above the
attention goal: at equal cost, attention only moves by regrouping the long sequences, which takes
several coordinated exchanges. This search starts from the other end:

1. *Attention-first start.* Sequences above ATTENTION_SHARE of the mean block attention go, longest
   first, to the block with the least attention (LPT on attention: it pairs the long ones largest
   with smallest). The rest fill the blocks: shortest first into the block with the most attention
   that still has attention room and stays under the mean block cost (short sequences carry the
   most cost per unit of attention, so they fill the attention-tight blocks), then the remaining
   ones by LPT on cost among blocks with attention room.
2. *Penalty descent.* Each block's excess over the caps, Σ_b max(0, cost_b/cost_cap − 1) +
   max(0, attention_b/goal − 1) (+ tokens over the token room), is lowered by the best move or
   swap of the whole partition per step (one vectorised (n × W/p) and (n × n) evaluation) until it
   is zero or no move or swap lowers it.

`search_partition` tries cost caps in stages (from the busiest block's cost before the search up to
`cost_cap`) and returns the first partition meeting all caps, or None. Cost O(n²) per step, so it
runs only for at most MAX_ITEMS sequences.
"""

from __future__ import annotations

import numpy as np

ATTENTION_SHARE = 0.1
"""Sequences above this share of the mean block attention are placed first, by attention."""
MAX_ITEMS = 128
"""The search runs only for steps of at most this many sequences (an (n × n) swap table a step)."""
MAX_STEPS = 64
"""Upper bound on move/swap steps of one penalty descent."""
COST_STAGES = (1 / 3, 2 / 3, 1.0)
"""Fractions of the way from the busiest block's cost to the cost cap tried in turn."""


def search_partition(values: np.ndarray, num_blocks: int, token_room: float, goal: float, cost_start: float,
                     cost_cap: float) -> np.ndarray | None:
    """A block index per sequence with every block's attention ≤ `goal`, tokens ≤ `token_room` and
    cost ≤ the first stage cap that works (caps from `cost_start` up to max(cost_start, cost_cap),
    module doc); None when none works or there are more than MAX_ITEMS sequences. `values` is
    (3, n): cost, attention, tokens (absolute block sums are compared with the caps)."""
    if values.shape[1] > MAX_ITEMS or num_blocks < 2:
        return None
    top = max(cost_start, cost_cap)
    caps = sorted({cost_start + (top - cost_start) * fraction for fraction in COST_STAGES})
    for cap in caps:
        blocks = attention_first_start(values, num_blocks, token_room, goal)
        if _descend(blocks, values, num_blocks, np.array([cap, goal, token_room])) <= 0:
            return blocks
    return None


def attention_first_start(values: np.ndarray, num_blocks: int, token_room: float, goal: float) -> np.ndarray:
    """Step 1 of the module doc (the token room is respected where some block has it)."""
    cost, attention, tokens = values
    mean_cost = float(cost.sum()) / num_blocks
    blocks = np.full(values.shape[1], -1)
    sums = np.zeros((3, num_blocks))

    def place(item: int, block: int) -> None:
        blocks[item] = block
        sums[:, block] += values[:, item]

    heavy = np.nonzero(attention > ATTENTION_SHARE * float(attention.sum()) / num_blocks)[0]
    for item in heavy[np.argsort(-attention[heavy], kind="stable")].tolist():
        fits = sums[2] + tokens[item] <= token_room
        place(item, int(np.argmin(np.where(fits, sums[1], np.inf))) if fits.any() else int(np.argmin(sums[2])))
    light = np.nonzero(blocks < 0)[0]
    for item in light[np.argsort(attention[light], kind="stable")].tolist():
        fits = (sums[1] + attention[item] <= goal) & (sums[0] + cost[item] <= mean_cost)
        fits &= sums[2] + tokens[item] <= token_room
        if fits.any():
            place(item, int(np.argmax(np.where(fits, sums[1], -np.inf))))
    light = np.nonzero(blocks < 0)[0]
    for item in light[np.argsort(-cost[light], kind="stable")].tolist():
        fits = (sums[1] + attention[item] <= goal) & (sums[2] + tokens[item] <= token_room)
        place(item, int(np.argmin(np.where(fits, sums[0], np.inf))) if fits.any() else int(np.argmin(sums[1])))
    return blocks


def _excess(loads: np.ndarray) -> np.ndarray:
    """Penalty of block loads already divided by their caps (summed over the first axis)."""
    return np.maximum(loads - 1, 0).sum(axis=0)


def _descend(blocks: np.ndarray, values: np.ndarray, num_blocks: int, caps: np.ndarray) -> float:
    """Step 2 of the module doc, in place on `blocks`; returns the penalty left (0: all caps met)."""
    scaled = values / np.where(np.isfinite(caps), caps, np.inf)[:, None]  # an infinite cap: never binding
    sums = np.stack([np.bincount(blocks, weights=row, minlength=num_blocks) for row in scaled])
    n = len(blocks)
    for _ in range(MAX_STEPS):
        current = _excess(sums)
        if current.sum() <= 0:
            return 0.0
        home = blocks
        # Moves: item i from its block to block b.
        gain_move = (current[home][:, None] + current[None, :] - _excess(sums[:, home] - scaled)[:, None]
                     - _excess(sums[:, None, :] + scaled[:, :, None]))
        gain_move[np.arange(n), home] = -np.inf
        # Swaps: items i and k trade blocks.
        delta = scaled[:, :, None] - scaled[:, None, :]
        gain_swap = (current[home][:, None] + current[home][None, :] - _excess(sums[:, home][:, :, None] - delta)
                     - _excess(sums[:, home][:, None, :] + delta))
        gain_swap[home[:, None] == home[None, :]] = -np.inf
        move = np.unravel_index(int(np.argmax(gain_move)), gain_move.shape)
        swap = np.unravel_index(int(np.argmax(gain_swap)), gain_swap.shape)
        if max(gain_move[move], gain_swap[swap]) <= 1e-12:
            break
        if gain_move[move] >= gain_swap[swap]:
            item, target = int(move[0]), int(move[1])
            sums[:, home[item]] -= scaled[:, item]
            sums[:, target] += scaled[:, item]
            blocks[item] = target
        else:
            first, second = int(swap[0]), int(swap[1])
            sums[:, home[first]] += scaled[:, second] - scaled[:, first]
            sums[:, home[second]] += scaled[:, first] - scaled[:, second]
            blocks[first], blocks[second] = blocks[second], blocks[first]
    return float(_excess(sums).sum())
