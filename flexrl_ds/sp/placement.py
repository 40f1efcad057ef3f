"""Placement of sharded sequences on aligned power-of-two rank blocks (LPT + local refinement). Pure.

Input per sequence: its per-rank cost `cost/d`, degree `d` and per-rank tokens `L/d`. A sequence of
degree `d` goes on a block `[k·d, (k+1)·d)` and adds its per-rank cost to each rank of the block.
Greedy longest-processing-time: sequences in decreasing per-rank cost, each onto the block whose
busiest rank is least loaded (among blocks that keep every rank under the token cap). Degree-1
sequences at the tail go through a heap. Then `refine` moves/swaps degree-1 sequences off the
busiest rank while that lowers it.
"""

from __future__ import annotations

import heapq

import numpy as np


class CapacityError(ValueError):
    """No block can take a sequence under the per-rank token cap."""


def place_lpt(per_rank_cost: np.ndarray, degrees: np.ndarray, per_rank_tokens: np.ndarray, *,
              world_size: int, token_cap: float, max_degree: int, allowed: tuple[int, ...]) -> np.ndarray:
    """Return the first rank of each sequence's block; may raise `degrees` where the cap needs it."""
    num = len(degrees)
    order = np.argsort(-per_rank_cost, kind="stable")
    loads = np.zeros(world_size)
    held = np.zeros(world_size)
    starts = np.zeros(num, dtype=np.int64)
    multi_positions = np.nonzero(degrees[order] > 1)[0]
    split = int(multi_positions[-1]) + 1 if len(multi_positions) else 0
    for item in order[:split].tolist():
        _place_on_block(item, per_rank_cost, degrees, per_rank_tokens, loads, held, starts,
                        token_cap, allowed)
    heap = [(float(loads[r]), r) for r in range(world_size)]
    heapq.heapify(heap)
    for item in order[split:].tolist():
        cost, tokens = float(per_rank_cost[item]), float(per_rank_tokens[item])
        skipped = []
        while heap and held[heap[0][1]] + tokens > token_cap:
            skipped.append(heapq.heappop(heap))
        if not heap:
            for entry in skipped:
                heapq.heappush(heap, entry)
            _place_on_block(item, per_rank_cost, degrees, per_rank_tokens, loads, held, starts,
                            token_cap, allowed)
            heap = [(float(loads[r]), r) for r in range(world_size)]
            heapq.heapify(heap)
            continue
        load, rank = heapq.heappop(heap)
        starts[item] = rank
        loads[rank] = load + cost
        held[rank] += tokens
        heapq.heappush(heap, (loads[rank], rank))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return starts


def _place_on_block(item: int, per_rank_cost: np.ndarray, degrees: np.ndarray, per_rank_tokens: np.ndarray,
                    loads: np.ndarray, held: np.ndarray, starts: np.ndarray, token_cap: float,
                    allowed: tuple[int, ...]) -> None:
    """Put one sequence on the least-loaded feasible block, doubling its degree if none fits."""
    degree = int(degrees[item])
    whole_cost = float(per_rank_cost[item]) * degree
    whole_tokens = float(per_rank_tokens[item]) * degree
    for candidate in (d for d in allowed if d >= degree):
        cost, tokens = whole_cost / candidate, whole_tokens / candidate
        block_load = loads.reshape(-1, candidate).max(axis=1)
        if token_cap != float("inf"):
            block_held = held.reshape(-1, candidate).max(axis=1)
            block_load = np.where(block_held + tokens <= token_cap, block_load, np.inf)
        block = int(np.argmin(block_load))
        if block_load[block] == np.inf:
            continue
        first = block * candidate
        loads[first:first + candidate] += cost
        held[first:first + candidate] += tokens
        starts[item] = first
        if candidate != degree:
            degrees[item] = candidate
            per_rank_cost[item] = cost
            per_rank_tokens[item] = tokens
        return
    raise CapacityError(item)


def refine_single(per_rank_cost: np.ndarray, degrees: np.ndarray, per_rank_tokens: np.ndarray,
                  starts: np.ndarray, *, world_size: int, token_cap: float, max_steps: int) -> None:
    """Move or swap degree-1 sequences between the busiest and least busy ranks while it helps."""
    from flexrl_ds.sp.metrics import rank_sums

    loads = rank_sums(per_rank_cost * degrees, degrees, starts, world_size)
    held = rank_sums(per_rank_tokens * degrees, degrees, starts, world_size)
    singles: dict[int, list[int]] = {r: [] for r in range(world_size)}
    for item in np.nonzero(degrees == 1)[0].tolist():
        singles[int(starts[item])].append(item)
    for _ in range(max_steps):
        top = int(np.argmax(loads))
        low = int(np.argmin(loads))
        gap = loads[top] - loads[low]
        if gap <= 0 or not singles[top]:
            return
        best = _best_exchange(singles[top], singles[low], per_rank_cost, per_rank_tokens, gap,
                              token_cap - held[low], token_cap - held[top])
        if best is None:
            return
        give, take = best
        delta = per_rank_cost[give] - (per_rank_cost[take] if take is not None else 0.0)
        tokens_delta = per_rank_tokens[give] - (per_rank_tokens[take] if take is not None else 0.0)
        loads[top] -= delta
        loads[low] += delta
        held[top] -= tokens_delta
        held[low] += tokens_delta
        singles[top].remove(give)
        singles[low].append(give)
        starts[give] = low
        if take is not None:
            singles[low].remove(take)
            singles[top].append(take)
            starts[take] = top


def _best_exchange(top_items: list[int], low_items: list[int], cost: np.ndarray, tokens: np.ndarray,
                   gap: float, low_room: float, top_room: float) -> tuple[int, int | None] | None:
    """The move (give, None) or swap (give, take) whose transferred cost is closest to gap/2."""
    best, best_score = None, gap  # score = new max of the pair minus the old low load
    for give in top_items:
        moved = cost[give]
        if moved < gap and tokens[give] <= low_room:
            score = max(gap - moved, moved)
            if score < best_score:
                best, best_score = (give, None), score
    if len(low_items) * len(top_items) <= 4096:
        for give in top_items:
            for take in low_items:
                moved = cost[give] - cost[take]
                if 0 < moved < gap and tokens[give] - tokens[take] <= low_room \
                        and tokens[take] - tokens[give] <= top_room:
                    score = max(gap - moved, moved)
                    if score < best_score:
                        best, best_score = (give, take), score
    return best
