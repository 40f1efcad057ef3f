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
1b. *Counted start* (tried first where it applies): where a block can hold at most q of the h
   heavy sequences (q + 1 of the lightest exceed the goal) and h > (q − 1) × blocks, exactly
   t = h − (q − 1) × blocks blocks must hold q of them; those blocks take the t·q lightest heavy
   sequences and the other blocks the rest, each group by LPT on attention under its count
   (image-heavy 512 sequences on 16 blocks, seed 16: 56 long videos, 8 blocks hold four: LPT on
   attention alone spreads the longest over the blocks of four and leaves them no attention room
   for the short sequences their cost still needs). The light sequences then fill as above.
2. *Penalty descent.* Each block's excess over the caps, Σ_b max(0, cost_b/cost_cap − 1) +
   max(0, attention_b/goal − 1) (+ tokens over the token room), is lowered by the best move, swap
   or one-for-two exchange (an item for two of another block's PAIR_ITEMS cheapest: at nearly
   equal cost it moves attention) per step, over every candidate touching a block above its caps
   (vectorised), until it is zero or nothing lowers it.

`search_partition` tries cost caps in stages (from the busiest block's cost before the search up to
`cost_cap`), each from the counted start and then the attention-first start, and returns the first
partition meeting all caps, or None. Its work is bounded by counted work, not by the step's size:
every scored candidate — a (giver, target block) of a move, a (giver, taken items) of an
exchange —, every sequence of a step (its O(n) bookkeeping) and START_ITEM_UNITS per sequence of
a start cost units out of WORK_BUDGET for the whole search; a descent step or start that does not
fit in what is left is not taken (the search then ends with what it has). So a failing search
costs about the same anywhere (tens of ms on the 2-core box), small steps run their descents to
the end, and the result is a pure function of the inputs (no clock).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ATTENTION_SHARE = 0.1
"""Sequences above this share of the mean block attention are placed first, by attention."""
WORK_BUDGET = 200_000
"""Work units (module doc: mostly scored candidates) one search may spend over all its starts and
descents (≈ 0.15–0.25 µs each on the 2-core box: a failing search stops after ~30–50 ms)."""
STEP_UNITS = 2_000
"""Least units a descent step is charged (its fixed numpy overhead, ≈ 0.3 ms)."""
START_ITEM_UNITS = 128
"""Units a start is charged per sequence (a Python step each, ≈ 25 µs: it is charged before it
runs, so steps of more than WORK_BUDGET / this sequences are not searched)."""
STEP_CAP = 25_000
"""Most candidates one descent step scores (larger steps are thinned evenly: `_step_candidates`)."""
MAX_STEPS = 32
"""Upper bound on move/swap steps of one penalty descent."""
PAIR_ITEMS = 8
"""One-for-two exchanges take two of a block's this many cheapest items (keeps a step small)."""
COST_STAGES = (2 / 3, 1.0)
"""Fractions of the way from the busiest block's cost to the cost cap tried in turn."""


@dataclass
class WorkMeter:
    """Counted work of one search (module doc)."""

    limit: int = WORK_BUDGET
    """Units the search may spend."""
    used: int = 0
    """Units spent so far."""

    def afford(self, units: int) -> bool:
        """Spend `units` if they fit in what is left; False (nothing spent) otherwise."""
        if self.used + units > self.limit:
            return False
        self.used += units
        return True


def search_partition(values: np.ndarray, num_blocks: int, token_room: float, goal: float, cost_start: float,
                     cost_cap: float, meter: WorkMeter | None = None) -> np.ndarray | None:
    """A block index per sequence with every block's attention ≤ `goal`, tokens ≤ `token_room` and
    cost ≤ the first stage cap that works (caps from `cost_start` up to max(cost_start, cost_cap),
    module doc); None when none works within the work budget (`meter`, default WORK_BUDGET units).
    `values` is (3, n): cost, attention, tokens (absolute block sums are compared with the caps)."""
    meter = meter if meter is not None else WorkMeter()
    if num_blocks < 2:
        return None
    top = max(cost_start, cost_cap)
    caps = sorted({cost_start + (top - cost_start) * fraction for fraction in COST_STAGES})
    starts = [attention_first_start]
    if _heavy_counts(values[1], num_blocks, goal) is not None:
        starts.insert(0, counted_start)
    for cap in caps:
        for start in starts:
            if not meter.afford(values.shape[1] * max(num_blocks, START_ITEM_UNITS)):
                return None
            blocks = start(values, num_blocks, token_room, goal)
            if blocks is not None and _descend(blocks, values, num_blocks, np.array([cap, goal, token_room]),
                                               meter) <= 0:
                return blocks
    return None


def attention_first_start(values: np.ndarray, num_blocks: int, token_room: float, goal: float) -> np.ndarray:
    """Step 1 of the module doc (the token room is respected where some block has it)."""
    attention, tokens = values[1], values[2]
    blocks, sums = np.full(values.shape[1], -1), np.zeros((3, num_blocks))
    for item in _heavy(attention, num_blocks).tolist():
        fits = sums[2] + tokens[item] <= token_room
        _place(values, blocks, sums, item,
               int(np.argmin(np.where(fits, sums[1], np.inf))) if fits.any() else int(np.argmin(sums[2])))
    return _fill_light(values, blocks, sums, token_room, goal)


def counted_start(values: np.ndarray, num_blocks: int, token_room: float, goal: float) -> np.ndarray | None:
    """Step 1b of the module doc: the heavy sequences by count (None where no block must hold
    more than one of them, or every block must hold the most)."""
    found = _heavy_counts(values[1], num_blocks, goal)
    if found is None:
        return None
    heavy, most, full = found
    tokens = values[2]
    blocks, sums = np.full(values.shape[1], -1), np.zeros((3, num_blocks))
    counts = np.zeros(num_blocks, dtype=np.int64)
    split = len(heavy) - full * most
    for group, first, last, limit in ((heavy[split:], 0, full, most), (heavy[:split], full, num_blocks, most - 1)):
        allowed = np.zeros(num_blocks, dtype=bool)
        allowed[first:last] = True
        for item in group.tolist():
            fits = allowed & (counts < limit) & (sums[2] + tokens[item] <= token_room)
            if not fits.any():
                return None
            _place(values, blocks, sums, item, int(np.argmin(np.where(fits, sums[1], np.inf))))
            counts[blocks[item]] += 1
    return _fill_light(values, blocks, sums, token_room, goal)


def _heavy_counts(attention: np.ndarray, num_blocks: int, goal: float) -> tuple[np.ndarray, int, int] | None:
    """(heavy sequences, most a block can hold, blocks that must hold that many) where the counted
    start applies (most ≥ 2 and some but not every block must hold the most), else None."""
    heavy = _heavy(attention, num_blocks)
    most = int(np.searchsorted(np.cumsum(attention[heavy][::-1]), goal, side="right"))
    full = len(heavy) - (most - 1) * num_blocks
    return (heavy, most, full) if most >= 2 and 1 <= full < num_blocks else None


def _heavy(attention: np.ndarray, num_blocks: int) -> np.ndarray:
    """Sequences above ATTENTION_SHARE of the mean block attention, most attention first."""
    heavy = np.nonzero(attention > ATTENTION_SHARE * float(attention.sum()) / num_blocks)[0]
    return heavy[np.argsort(-attention[heavy], kind="stable")]


def _place(values: np.ndarray, blocks: np.ndarray, sums: np.ndarray, item: int, block: int) -> None:
    blocks[item] = block
    sums[:, block] += values[:, item]


def _fill_light(values: np.ndarray, blocks: np.ndarray, sums: np.ndarray, token_room: float,
                goal: float) -> np.ndarray:
    """The sequences not placed yet (step 1 of the module doc, second part); returns `blocks`."""
    cost, attention, tokens = values
    mean_cost = float(cost.sum()) / sums.shape[1]
    light = np.nonzero(blocks < 0)[0]
    for item in light[np.argsort(attention[light], kind="stable")].tolist():
        fits = (sums[1] + attention[item] <= goal) & (sums[0] + cost[item] <= mean_cost)
        fits &= sums[2] + tokens[item] <= token_room
        if fits.any():
            _place(values, blocks, sums, item, int(np.argmax(np.where(fits, sums[1], -np.inf))))
    light = np.nonzero(blocks < 0)[0]
    for item in light[np.argsort(-cost[light], kind="stable")].tolist():
        fits = (sums[1] + attention[item] <= goal) & (sums[2] + tokens[item] <= token_room)
        _place(values, blocks, sums, item,
               int(np.argmin(np.where(fits, sums[0], np.inf))) if fits.any() else int(np.argmin(sums[1])))
    return blocks


def _excess(loads: np.ndarray) -> np.ndarray:
    """Penalty of block loads already divided by their caps (summed over the first axis)."""
    return np.maximum(loads - 1, 0).sum(axis=0)


def _descend(blocks: np.ndarray, values: np.ndarray, num_blocks: int, caps: np.ndarray, meter: WorkMeter) -> float:
    """Step 2 of the module doc, in place on `blocks`; returns the penalty left (0: all caps met).
    Only changes touching a block over its caps can lower the penalty, so every candidate has its
    giver or its taken items in such a block (keeps a step O(hot items × n)). A step is taken only
    if `meter` affords its candidates."""
    scaled = values / np.where(np.isfinite(caps), caps, np.inf)[:, None]  # an infinite cap: never binding
    sums = np.stack([np.bincount(blocks, weights=row, minlength=num_blocks) for row in scaled])
    for _ in range(MAX_STEPS):
        current = _excess(sums)
        if current.sum() <= 0:
            return 0.0
        hot, everyone, first, second, units = _step_candidates(blocks, scaled, current)
        if not meter.afford(max(units, STEP_UNITS) + len(blocks)):
            break
        in_hot = current[blocks[first]] > 0
        found = [_best_move(blocks, scaled, sums, current, hot),
                 _best_exchange(blocks, scaled, sums, current, hot, everyone, None),
                 _best_exchange(blocks, scaled, sums, current, hot, first, second),
                 _best_exchange(blocks, scaled, sums, current, everyone, first[in_hot], second[in_hot])]
        gain, relocations = max(found, key=lambda candidate: candidate[0])
        if gain <= 1e-12:
            break
        for item, target in relocations:
            sums[:, blocks[item]] -= scaled[:, item]
            sums[:, target] += scaled[:, item]
            blocks[item] = target
    return float(_excess(sums).sum())


def _step_candidates(blocks, scaled, current):
    """(hot givers, all items, cheap pairs' first and second items, units) of one descent step: the
    hot givers are the items of blocks over their caps; where the step would score more than
    STEP_CAP candidates, every other hot giver, item and pair is dropped (evenly, deterministic)
    until it fits, so a large step still takes several steps of the budget."""
    hot = np.nonzero(current[blocks] > 0)[0]
    everyone = np.arange(len(blocks))
    first, second = _cheap_pairs(blocks, scaled)
    while True:
        in_hot = int((current[blocks[first]] > 0).sum())
        units = len(hot) * (len(current) + len(everyone) + len(first)) + len(everyone) * in_hot
        if units <= STEP_CAP or len(hot) <= 1:
            return hot, everyone, first, second, units
        hot, everyone, first, second = hot[::2], everyone[::2], first[::2], second[::2]


def _best_move(blocks, scaled, sums, current, givers):
    """(penalty drop, [(item, new block)]) of the best move of one of `givers`."""
    gain = (current[blocks[givers]][:, None] + current[None, :]
            - _excess(sums[:, blocks[givers]] - scaled[:, givers])[:, None]
            - _excess(sums[:, None, :] + scaled[:, givers, None]))
    gain[np.arange(len(givers)), blocks[givers]] = -np.inf
    g, target = np.unravel_index(int(np.argmax(gain)), gain.shape)
    return float(gain[g, target]), [(int(givers[g]), int(target))]


def _cheap_pairs(blocks, scaled):
    """All pairs (first, second) of items of one block among its PAIR_ITEMS cheapest."""
    ranked = np.lexsort((scaled[0], blocks))
    counts = np.bincount(blocks)
    position = np.arange(len(ranked)) - np.repeat(np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    cheap = ranked[position < PAIR_ITEMS]
    first, second = np.triu_indices(len(cheap), 1)
    same = blocks[cheap[first]] == blocks[cheap[second]]
    return cheap[first[same]], cheap[second[same]]


def _best_exchange(blocks, scaled, sums, current, givers, takers, second_takers):
    """(penalty drop, relocations) of the best exchange of one of `givers` for one of `takers`
    (plus the matching `second_takers` item of the taker's block when given: a one-for-two): the
    giver goes to the taker's block, the taken items to the giver's block."""
    if len(givers) == 0 or len(takers) == 0:
        return -np.inf, []
    taken = scaled[:, takers] + (scaled[:, second_takers] if second_takers is not None else 0.0)
    home, other = blocks[givers], blocks[takers]
    delta = scaled[:, givers][:, :, None] - taken[:, None, :]
    gain = (current[home][:, None] + current[other][None, :] - _excess(sums[:, home][:, :, None] - delta)
            - _excess(sums[:, other][:, None, :] + delta))
    gain[home[:, None] == other[None, :]] = -np.inf
    g, t = np.unravel_index(int(np.argmax(gain)), gain.shape)
    relocations = [(int(givers[g]), int(other[t])), (int(takers[t]), int(home[g]))]
    if second_takers is not None:
        relocations.append((int(second_takers[t]), int(home[g])))
    return float(gain[g, t]), relocations
