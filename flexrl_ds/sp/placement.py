"""Placement of sharded sequences on aligned power-of-two rank blocks (LPT + local refinement). Pure.

Per sequence: degree `d`, per-rank cost `cost/d`, attention `L²/d` and tokens `L/d`. A sequence of
degree `d` goes on a block `[k·d, (k+1)·d)` and adds its per-rank shares to every rank of the block.

Greedy longest-processing-time: sequences in decreasing per-rank cost, each onto the block whose
busiest rank ends up least loaded, among blocks that keep every rank under the token cap. "Load" is
the cost normalised by its target, or — with `attention_aware` — the larger of cost and attention
each normalised by its target, so attention-heavy long sequences and linear-heavy short ones spread
evenly in both. Degree-1 sequences after the last sharded one go through a heap (cost only: they
carry little attention). `refine` then moves or swaps sequences of equal degree between blocks
while that lowers the busiest rank's cost.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


ATTENTION_SHARE_2D = 0.1
"""Degree-1 sequences above this fraction of the per-rank attention target are placed 2-D."""
ATTENTION_REFINE_REACH = 0.05
"""Attention refinement only starts within goal + this of the goal (closer gaps are cheap to close)."""
SWAP_BLOCKS = 8
"""Refinement looks for swap partners on this many least-loaded blocks (keeps a step O(n))."""


class CapacityError(ValueError):
    """No block can take a sequence under the per-rank token cap (args[0]: the sequence index)."""


@dataclass
class Layout:
    """Per-sequence placement state (arrays are indexed by sequence)."""

    degrees: np.ndarray
    """Degree of each sequence (may be raised by placement when the token cap needs it)."""
    cost: np.ndarray
    """Whole-sequence cost L² + c·L."""
    attention: np.ndarray
    """Whole-sequence attention L²."""
    tokens: np.ndarray
    """Whole-sequence tokens L."""
    starts: np.ndarray
    """First rank of each sequence's block."""


class _RankState:
    """Per-rank running sums, as Python lists (fast scalar reads in the heap loop) mirrored in
    numpy arrays (fast block maxima for sharded sequences)."""

    def __init__(self, world_size: int) -> None:
        self.cost, self.attn, self.held = [0.0] * world_size, [0.0] * world_size, [0.0] * world_size
        self.cost_np, self.attn_np, self.held_np = np.zeros(world_size), np.zeros(world_size), np.zeros(world_size)

    def add(self, first: int, degree: int, cost: float, attn: float, tokens: float) -> None:
        for rank in range(first, first + degree):
            self.cost[rank] += cost
            self.attn[rank] += attn
            self.held[rank] += tokens
        if degree == 1:  # scalar stores are much cheaper than slice updates
            self.cost_np[first] = self.cost[first]
            self.attn_np[first] = self.attn[first]
            self.held_np[first] = self.held[first]
        else:
            end = first + degree
            self.cost_np[first:end] += cost
            self.attn_np[first:end] += attn
            self.held_np[first:end] += tokens


def place_lpt(layout: Layout, *, world_size: int, token_cap: float, allowed: tuple[int, ...],
              cost_target: float, attn_target: float | None) -> None:
    """Fill `layout.starts` (LPT); `attn_target=None` balances cost only."""
    order = np.argsort(-(layout.cost / layout.degrees), kind="stable").tolist()
    state = _RankState(world_size)
    scales = (1.0 / cost_target, 1.0 / attn_target if attn_target else 0.0)
    capped = token_cap != float("inf")
    # With attention balancing, degree-1 sequences carrying a sizeable share of a rank's attention
    # are also placed 2-D; the rest (linear-dominated) fill by cost through the heap.
    two_d = (layout.attention * scales[1] > ATTENTION_SHARE_2D).tolist()
    degree_of, cost_of = layout.degrees.tolist(), layout.cost.tolist()
    per_item = (degree_of, cost_of, layout.attention.tolist(), layout.tokens.tolist(), two_d)
    last_special = max((k for k, i in enumerate(order) if degree_of[i] > 1 or two_d[i]), default=-1)
    position = 0
    while position < len(order):
        chunk = order[position:position + world_size]
        if not capped and position > last_special \
                and max(state.cost) - min(state.cost) <= cost_of[chunk[-1]]:
            # Loads differ by less than any item of this round: LPT places it one item per rank,
            # largest on least loaded — done as one numpy round.
            _round(layout, np.array(chunk, dtype=np.int64), state)
        else:
            _lpt_items(layout, chunk, state, token_cap, allowed, scales, per_item)
        position += len(chunk)


def _round(layout: Layout, items: np.ndarray, state: _RankState) -> None:
    ranks = np.argsort(state.cost_np, kind="stable")[:len(items)]
    layout.starts[items] = ranks
    for array, values in ((state.cost_np, layout.cost), (state.attn_np, layout.attention),
                          (state.held_np, layout.tokens)):
        array[ranks] += values[items]
    state.cost, state.attn, state.held = state.cost_np.tolist(), state.attn_np.tolist(), state.held_np.tolist()


def _lpt_items(layout: Layout, items: list[int], state: _RankState, token_cap: float, allowed: tuple[int, ...],
               scales: tuple[float, float], per_item: tuple[list, ...]) -> None:
    """One-at-a-time LPT: degree-1 items to the least-loaded rank with room (heap), the others
    (sharded, attention-heavy, or finding no single rank with room) through block scoring."""
    heap = [(load, rank) for rank, load in enumerate(state.cost)]
    heapq.heapify(heap)  # lazy: stale entries are skipped on pop
    capped = token_cap != float("inf")
    degree_of, cost_of, attention_of, tokens_of, two_d = per_item
    for item in items:
        chosen = None
        if degree_of[item] == 1 and not two_d[item]:
            tokens, skipped = tokens_of[item], []
            while heap:
                load, rank = heapq.heappop(heap)
                if load != state.cost[rank]:
                    continue  # stale entry
                if capped and state.held[rank] + tokens > token_cap:
                    skipped.append((load, rank))
                    continue
                chosen = rank
                break
            for entry in skipped:
                heapq.heappush(heap, entry)
        if chosen is None:
            first, degree = _place_on_block(item, layout, state, token_cap, allowed, scales)
            layout.starts[item] = first
            for rank in range(first, first + degree):
                heapq.heappush(heap, (state.cost[rank], rank))
            continue
        layout.starts[item] = chosen
        state.add(chosen, 1, cost_of[item], attention_of[item], tokens)
        heapq.heappush(heap, (state.cost[chosen], chosen))


def _place_on_block(item: int, layout: Layout, state: _RankState, token_cap: float, allowed: tuple[int, ...],
                    scales: tuple[float, float]) -> tuple[int, int]:
    """Put one sequence on the best feasible block (doubling its degree if no block has room);
    return (first rank, degree). Score of a block: its busiest rank after adding, in units of the
    cost target — or the larger of cost and attention in units of their targets."""
    loads, attn, held = state.cost_np, state.attn_np, state.held_np
    current = int(layout.degrees[item])
    for degree in allowed:
        if degree < current:
            continue
        cost, tokens = layout.cost[item] / degree, layout.tokens[item] / degree
        add_attn = layout.attention[item] / degree
        score = (loads.reshape(-1, degree).max(axis=1) + cost) * scales[0]
        if scales[1] > 0:
            score = np.maximum(score, (attn.reshape(-1, degree).max(axis=1) + add_attn) * scales[1])
        if token_cap != float("inf"):
            room = held.reshape(-1, degree).max(axis=1) + tokens <= token_cap
            score = np.where(room, score, np.inf)
        block = int(np.argmin(score))
        if score[block] == np.inf:
            continue
        first = block * degree
        state.add(first, degree, float(cost), float(add_attn), float(tokens))
        layout.degrees[item] = degree
        return first, degree
    raise CapacityError(item)


def _rank_sum(values: np.ndarray, layout: Layout, world_size: int) -> np.ndarray:
    diff = np.zeros(world_size + 1)
    share = values / layout.degrees
    np.add.at(diff, layout.starts, share)
    np.add.at(diff, layout.starts + layout.degrees, -share)
    return np.cumsum(diff[:-1])


def refine(layout: Layout, *, world_size: int, token_cap: float, max_steps: int, allowed: tuple[int, ...],
           good_enough: float = 0.0) -> None:
    """Move/swap equal-degree sequences off the busiest rank's blocks while its cost drops; when
    no such step exists, re-place one of its sequences at another allowed degree.

    A step is taken only if the receiving block's busiest rank stays strictly below the current
    maximum (so the maximum never rises and each step removes load from a busiest rank), no rank
    exceeds the token cap, and no rank's attention exceeds the current attention maximum.
    """
    loads = _rank_sum(layout.cost, layout, world_size)
    held = _rank_sum(layout.tokens, layout, world_size)
    attn = _rank_sum(layout.attention, layout, world_size)
    if loads.max() <= good_enough:
        return
    ends = layout.starts + layout.degrees
    for _ in range(max_steps):
        top = int(np.argmax(loads))
        peak = loads[top]
        if peak <= good_enough:
            return
        on_top = np.nonzero((layout.starts <= top) & (ends > top))[0]
        best = None  # (new receiving max, give, take or -1, target start)
        guard = (attn, layout.attention, attn.max())
        for degree in np.unique(layout.degrees[on_top]).tolist():
            best = _best_step(layout, on_top[layout.degrees[on_top] == degree], degree, (loads, layout.cost),
                              guard, held, peak, token_cap, best)
        if best is None:
            regree = _best_regree(layout, on_top, loads, held, attn, peak, token_cap, allowed)
            if regree is None:
                return
            _, give, degree, target = regree
            _shift(layout, give, target, loads, held, attn, new_degree=degree)
            ends = layout.starts + layout.degrees
            continue
        _, give, take, target = best
        home_start = int(layout.starts[give])
        _shift(layout, give, target, loads, held, attn)
        if take >= 0:
            _shift(layout, take, home_start, loads, held, attn)
        ends = layout.starts + layout.degrees


def refine_attention(layout: Layout, *, world_size: int, token_cap: float, max_steps: int,
                     cost_ceiling: float, goal: float) -> None:
    """Move/swap equal-degree sequences off the rank with the most attention while its attention
    balance is above `goal`, never letting any rank's cost exceed `cost_ceiling` (nor the cap)."""
    loads = _rank_sum(layout.cost, layout, world_size)
    held = _rank_sum(layout.tokens, layout, world_size)
    attn = _rank_sum(layout.attention, layout, world_size)
    mean = float(attn.mean())
    ceiling = max(cost_ceiling, float(loads.max()))
    if mean <= 0 or attn.max() > (goal + ATTENTION_REFINE_REACH) * mean:
        return  # too far off: only more sharding (another candidate) gets there
    for _ in range(max_steps):
        top = int(np.argmax(attn))
        peak = attn[top]
        if mean <= 0 or peak <= goal * mean:
            return
        ends = layout.starts + layout.degrees
        on_top = np.nonzero((layout.starts <= top) & (ends > top))[0]
        best = None
        for degree in np.unique(layout.degrees[on_top]).tolist():
            best = _best_step(layout, on_top[layout.degrees[on_top] == degree], degree,
                              (attn, layout.attention), (loads, layout.cost, ceiling), held, peak, token_cap, best)
        if best is None:
            return
        _, give, take, target = best
        home_start = int(layout.starts[give])
        _shift(layout, give, target, loads, held, attn)
        if take >= 0:
            _shift(layout, take, home_start, loads, held, attn)


def _best_step(layout: Layout, givers: np.ndarray, degree: int, objective: tuple[np.ndarray, np.ndarray],
               guard: tuple[np.ndarray, np.ndarray, float], held: np.ndarray, peak: float, token_cap: float,
               best):
    """Best move or swap of one of `givers` (degree `degree`, all on the block of the rank where
    `objective` peaks): it must lower that rank, keep the receiving block below `peak`, keep the
    `guard` quantity under its ceiling and every rank under the token cap.
    `objective` / `guard` are (per-rank sums, per-sequence values)."""
    loads, values = objective
    guard_ranks, guard_values, guard_ceiling = guard
    block_max = loads.reshape(-1, degree).max(axis=1)
    block_held = held.reshape(-1, degree).max(axis=1)
    block_guard = guard_ranks.reshape(-1, degree).max(axis=1)
    home = int(layout.starts[givers[0]]) // degree
    give_share = values[givers] / degree
    give_tokens = layout.tokens[givers] / degree
    give_guard = guard_values[givers] / degree
    # Moves: giver to another block; prefer the one leaving the receiving block lowest.
    new_max = block_max[None, :] + give_share[:, None]
    ok = (new_max < peak) & (block_held[None, :] + give_tokens[:, None] <= token_cap)
    ok &= block_guard[None, :] + give_guard[:, None] <= guard_ceiling
    ok[:, home] = False
    if ok.any():
        masked = np.where(ok, new_max, np.inf)
        g, b = np.unravel_index(int(np.argmin(masked)), masked.shape)
        candidate = (float(masked[g, b]), int(givers[g]), -1, int(b) * degree)
        if best is None or candidate[0] < best[0]:
            best = candidate
    # Swaps with a smaller sequence of the same degree on one of the few least-loaded other blocks.
    light = np.argsort(block_max)[:SWAP_BLOCKS + 1]
    light = light[light != home][:SWAP_BLOCKS]
    is_light = np.zeros(len(block_max), dtype=bool)
    is_light[light] = True
    others = np.nonzero((layout.degrees == degree) & is_light[layout.starts // degree])[0]
    if len(others):
        other_block = layout.starts[others] // degree
        delta = give_share[:, None] - values[others][None, :] / degree
        tokens_delta = give_tokens[:, None] - layout.tokens[others][None, :] / degree
        guard_delta = give_guard[:, None] - guard_values[others][None, :] / degree
        new_max = block_max[other_block][None, :] + delta
        ok = (delta > 0) & (new_max < peak)
        ok &= (block_held[other_block][None, :] + tokens_delta <= token_cap) & (block_held[home] - tokens_delta <= token_cap)
        ok &= block_guard[other_block][None, :] + guard_delta <= guard_ceiling
        ok &= block_guard[home] - guard_delta <= guard_ceiling
        if ok.any():
            masked = np.where(ok, np.maximum(new_max, peak - delta), np.inf)
            g, t = np.unravel_index(int(np.argmin(masked)), masked.shape)
            candidate = (float(masked[g, t]), int(givers[g]), int(others[t]), int(other_block[t]) * degree)
            if best is None or candidate[0] < best[0]:
                best = candidate
    return best


def _best_regree(layout: Layout, givers: np.ndarray, loads: np.ndarray, held: np.ndarray, attn: np.ndarray,
                 peak: float, token_cap: float, allowed: tuple[int, ...]):
    """Best re-placement of one giver at a different degree: (new max, item, degree, first rank)."""
    best = None
    attn_ceiling = attn.max()
    for item in givers.tolist():
        degree, first = int(layout.degrees[item]), int(layout.starts[item])
        without = [array.copy() for array in (loads, held, attn)]
        for array, value in zip(without, (layout.cost, layout.tokens, layout.attention)):
            array[first:first + degree] -= value[item] / degree
        for other in allowed:
            if other == degree:
                continue
            new_max = without[0].reshape(-1, other).max(axis=1) + layout.cost[item] / other
            ok = (new_max < peak) & (without[1].reshape(-1, other).max(axis=1) + layout.tokens[item] / other
                                     <= token_cap)
            ok &= without[2].reshape(-1, other).max(axis=1) + layout.attention[item] / other <= attn_ceiling
            if ok.any():
                block = int(np.argmin(np.where(ok, new_max, np.inf)))
                if best is None or new_max[block] < best[0]:
                    best = (float(new_max[block]), item, other, block * other)
    return best


def _shift(layout: Layout, item: int, target: int, loads: np.ndarray, held: np.ndarray,
           attn: np.ndarray, new_degree: int | None = None) -> None:
    degree = int(layout.degrees[item])
    new_degree = new_degree or degree
    source = int(layout.starts[item])
    for array, value in ((loads, layout.cost), (held, layout.tokens), (attn, layout.attention)):
        array[source:source + degree] -= value[item] / degree
        array[target:target + new_degree] += value[item] / new_degree
    layout.degrees[item] = new_degree
    layout.starts[item] = target
