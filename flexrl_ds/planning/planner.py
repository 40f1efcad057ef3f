"""FlexUlysses planner: per-step degrees, aligned groups, packs and HSF order. Pure (numpy only).

Public API (stable; the executor calls it once per step and SP domain):

    result = plan_step(workload, world_size, cost_model, sp_config)   # -> PlanResult
    result.plan        # Plan: packs on aligned blocks + HSF rank_order (docs/PLAN_SCHEMA.md)
    result.workload    # the workload actually planned (after oversize drop/truncate)
    result.dropped / result.truncated / result.metrics

Objective: the busiest rank's modelled time. With a calibration that has the step-time fits
(planning/step_time.py) that is seconds — attention a·L² + b·L on the rank's query heads, linear
s·L ÷ d, and per sharded sequence its pack's attention floor and the all-to-all not hidden by
overlap; attention balance is then only reported. Without one it is the FLOP formula L² + c·L
(head-aware too), with attention balance as a secondary room.

Algorithm (p = the largest allowed degree):
1. Every sequence of degree ≤ p lies in one aligned p-block, so a plan is first a partition of the
   sequences over the W/p p-blocks (`partition_blocks`, placement.py), balanced on what a block's
   busiest rank does at fixed SP under the executor's head split: LPT on cost and, formula only, a
   2-D LPT, refined by moves/swaps on cost, then on attention under a cost ceiling, then 2-for-1
   exchanges lowering attention without raising the busiest block's cost.
2. Per-rank rooms, tightest first: cost `(1 + balance_tolerance) ×` busiest block ÷ p, then what
   fixed SP at p reaches on this partition under the true head split (with overheads); attention
   `max((1 + balance_tolerance) × busiest block ÷ p, attention_goal × mean)` (formula only);
   tokens `max_tokens_per_rank`.
3. Each p-block is split by recursive halving under per-rank rooms (`split_block`, split.py): the
   k largest shardable sequences stay at the block's degree, the rest go to the two halves so both
   fit the rooms left; smallest such k; recurse. Ranks holding fewer heads of the block's sharded
   sequences get more room. Sequences under `min_shard_tokens` stay whole where they carry ≥
   `short_share` of a block's cost and that costs ≤ `short_tolerance`. The room giving the least
   busiest rank is kept, and fixed SP at p on the same partition is the fallback.
4. Pack sequences sharing a group (packing.py); number packs in HSF order (schedule.py).
5. With a calibration, the candidates are scored exactly (packed, in HSF order: `layout_step_time`)
   and the least modelled step time wins: this nested layout, the nested layout of the FLOP
   formula (what the planner gives without a calibration), the greedy layout (layouts.py) and
   fixed SP at every allowed degree. The objective's per-sequence overheads are a proxy (a short
   sequence is charged its share of a packed call's floor and all-to-all, as packing runs it), so
   the chosen plan is never worse, under the model, than the formula plan, the greedy or fixed SP.
Guarantee (no token cap, no short sequences kept whole): the busiest rank's modelled time is at
most (1 + balance_tolerance) × that of fixed SP at p on the planner's partition, and at most
(1 + balance_tolerance)² × that of fixed SP at p on fixed SP's own LPT partition (split too where
the planner's is worse by more than the tolerance); all-to-all volume ≤ fixed SP's at p. The
attention repair and attention-first search of earlier versions are gone: on 45 generated cells
they never lowered the busiest rank (they traded up to 0.4 % of it for attention balance), so
under this objective they did not pay.

Head rule (`PlannerOptions.head_rule`): Ulysses scatters query heads over the group. "uneven"
(default) allows every power-of-two degree ≤ min(p_max, num_heads) (every rank needs a query head;
the plan's `degree_cap` says which limit bound); when d does not divide num_heads the executor
uses an uneven-heads all-to-all (some ranks get one more head: planning/heads.py). "divisible"
only allows degrees that divide num_heads (Qwen2.5-VL-7B: 28 heads → at most 4). KV heads fewer
than d are replicated so each
rank holds the KV heads its query heads use; KV heads more than d are scattered like query heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import CostModel
from flexrl_ds.planning.heads import heads_per_rank, max_degree_for_heads
from flexrl_ds.planning.layouts import (fixed_sp_time_floor, greedy_layout, layout_step_time,  # noqa: F401
                                        packed_groups)  # (re-exported: callers import them from here)
from flexrl_ds.planning.metrics import PlanMetrics, compute_metrics, head_shares, with_step_time
from flexrl_ds.planning.packing import PackingLimits, packing_limits
from flexrl_ds.planning.placement import lpt_groups, partition_blocks
from flexrl_ds.planning.split import CapacityError, Items, rank_costs, split_block
from flexrl_ds.planning.step_time import StepTime, sequence_terms, sharding_overhead
from flexrl_ds.planning.plan import Pack, Plan, SequenceSpec, Workload, is_power_of_two
from flexrl_ds.planning.schedule import hsf_key


@dataclass(frozen=True)
class PlannerOptions:
    """Knobs of the planner beyond SPConfig (defaults are what the benchmarks use)."""

    head_rule: str = "uneven"
    """"uneven": any power-of-two degree (uneven-heads all-to-all); "divisible": d | num_heads."""
    balance_tolerance: float = 0.001
    """Per-rank cost room = (1 + this) × the busiest p-block's cost ÷ p after partitioning (what
    fixed SP at p reaches): less sharding is accepted only within this fraction of it."""
    attention_goal: float = 1.02
    """Per-rank attention room = max((1 + balance_tolerance) × busiest p-block's attention ÷ p,
    this × mean): attention balance stays at the partition's bound or within this goal."""
    min_shard_tokens: int = 1024
    """Sequences shorter than this stay at degree 1 (a sharded chunk of under ~512 tokens per rank
    is latency-bound) unless the token cap needs more; they are packed instead."""
    short_share: float = 0.25
    """Short sequences stay whole in a p-block only where they carry at least this share of its
    cost (the block's work is mostly short sequences: sharding them would multiply tiny,
    latency-bound collectives) ..."""
    short_tolerance: float = 0.01
    """... and the busiest rank then stays within (1 + this) × that of the block split with every
    sequence shardable. Elsewhere every sequence may be sharded (efficiency first)."""
    refine_steps: int = 48
    """Upper bound on move/swap steps of each block-partition refinement."""


@dataclass(frozen=True)
class PlanResult:
    """What `plan_step` returns."""

    plan: Plan
    """The plan (packs, HSF rank_order); `plan.extra` holds metrics and options for the file."""
    workload: Workload
    """Sequences actually planned: dropped ones removed, truncated ones shortened."""
    metrics: PlanMetrics
    """Balance, efficiency, degree histogram, all-to-all volume."""
    dropped: tuple[str, ...] = ()
    """Ids removed because they cannot fit at p_max under the token cap (oversize=drop)."""
    truncated: dict[str, tuple[int, int]] = field(default_factory=dict)
    """id -> (original tokens, planned tokens) for oversize=truncate."""
    limits: PackingLimits | None = None
    """h_pack / H_pack actually used."""


HEAD_RULES = ("uneven", "divisible")


class StepOverflowError(ValueError):
    """The step's sequences do not fit the SP domain together under `max_tokens_per_rank` (each
    one alone would): fewer of them at a time would (planning/micro_batches.py)."""


def allowed_degrees(world_size: int, sp: SPConfig, cost: CostModel, head_rule: str) -> tuple[int, ...]:
    """Powers of two ≤ min(p_max, world_size, query heads), filtered by the head rule; validates
    world_size/p_max. The head cap holds under every rule: each rank of a pack needs one query head
    (`build_rank_layout` rejects a degree above the head count)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not is_power_of_two(sp.p_max):
        raise ValueError(f"p_max {sp.p_max} is not a power of two")
    p_eff = min(sp.p_max, world_size)
    if not is_power_of_two(p_eff) or world_size % p_eff:
        raise ValueError(f"world_size {world_size} is not a multiple of the group size p_max={sp.p_max}")
    if head_rule not in HEAD_RULES:
        raise ValueError(f"head_rule {head_rule!r} is not one of {', '.join(HEAD_RULES)}")
    degrees = [1 << k for k in range(p_eff.bit_length()) if (1 << k) <= min(p_eff, cost.num_heads)]
    if head_rule == "divisible":
        degrees = [d for d in degrees if cost.num_heads % d == 0]
    return tuple(degrees)


def degree_cap(world_size: int, sp: SPConfig, cost: CostModel, allowed: tuple[int, ...]) -> dict:
    """What bounds the largest degree (for the plan summary): p_max, the world size, the query
    heads or the head rule."""
    limits = {"p_max": sp.p_max, "world_size": world_size, "num_heads": cost.num_heads}
    binding = [name for name, value in limits.items() if max_degree_for_heads(value) == allowed[-1]]
    return {"max_degree": allowed[-1], "by": binding[0] if binding else "head_rule", **limits}


def apply_oversize(workload: Workload, sp: SPConfig, max_degree: int
                   ) -> tuple[Workload, tuple[str, ...], dict[str, tuple[int, int]]]:
    """Handle sequences longer than max_degree × max_tokens_per_rank per `sp.oversize`."""
    cap = sp.max_tokens_per_rank
    if cap is None:
        return workload, (), {}
    limit = cap * max_degree
    kept, dropped, truncated = [], [], {}
    for seq in workload.sequences:
        if seq.tokens <= limit:
            kept.append(seq)
        elif sp.oversize == "error":
            raise ValueError(
                f"sequence {seq.id!r}: {seq.tokens} tokens cannot fit on {max_degree} ranks under "
                f"max_tokens_per_rank={cap} (raise flexrl.sp.max_tokens_per_rank or p_max; the planning "
                "tools can also drop or truncate it: flexrl.sp.oversize)")
        elif sp.oversize == "drop":
            dropped.append(seq.id)
        else:
            truncated[seq.id] = (seq.tokens, limit)
            kept.append(replace(seq, tokens=limit, vision_tokens=min(seq.vision_tokens, limit)))
    if not kept and workload.sequences:
        raise ValueError(f"every sequence exceeds max_tokens_per_rank={cap} × {max_degree}; nothing to plan")
    return Workload(tuple(kept)), tuple(dropped), truncated


def objective_terms(tokens: np.ndarray, cost: CostModel, allowed: tuple[int, ...], overlap: bool,
                    limits: PackingLimits | None = None):
    """(values (3, n), overheads per degree, attention room on?) of the planner's objective, in
    units of L². Formula: cost L² + c·L, attention L², no overheads. Calibrated (planning/
    step_time.py): attention L² + (b/a)·L, cost that + (s/a)·L, and per degree ≥ 2 the per-rank
    floor + exposed all-to-all a sharded sequence pays ÷ (a · layers): the busiest rank's cost is
    then its modelled seconds, and attention balance is only reported. `limits`: a sequence under
    h_pack pays its share of a packed call's floor and all-to-all, as packing runs it (None: one
    call of its own)."""
    step = cost.step
    if step is None:
        return np.stack([tokens * tokens + cost.c * tokens, tokens * tokens, tokens]), {}, True
    unit = step.attention_fit[0] * step.num_layers
    attention, linear = sequence_terms(tokens, step)
    values = np.stack([(attention + linear) / unit, attention / unit, tokens])
    packing = (limits.h_pack, limits.H_pack) if limits is not None else None
    overheads = {d: sharding_overhead(tokens, d, step, cost.num_heads, cost.num_kv_heads, cost.shapes.head_dim,
                                      overlap, packing) / unit for d in allowed if d > 1}
    return values, overheads, False


def nested_layout(tokens: np.ndarray, c: float, allowed: tuple[int, ...], world_size: int, token_cap: float,
                  options: PlannerOptions, heads: tuple[int, int] | None = None,
                  terms=None) -> tuple[np.ndarray, np.ndarray]:
    """(degree, first rank) of every sequence: p-block partition, then recursive halving under
    per-rank rooms (placement.py, split.py; module docstring). `heads` (query, KV): each rank is
    costed by the query heads it holds (planning/heads.py); None: an even split. `terms`:
    `objective_terms` (None: the formula with this `c`)."""
    block_size = allowed[-1]
    assert allowed == tuple(1 << k for k in range(len(allowed))), allowed  # a prefix of powers of two
    num_blocks = world_size // block_size
    if terms is None:
        terms = (np.stack([tokens * tokens + c * tokens, tokens * tokens, tokens]), {}, True)
    values, overheads, attention_room = terms
    if not attention_room:
        options = replace(options, attention_goal=float("inf"))
    shares = {d: head_shares(*(heads or (None, None)), d) for d in allowed}  # type: ignore[call-arg]
    items = Items(values, tokens < options.min_shard_tokens, np.ones(len(tokens), dtype=np.int64),
                  np.zeros(len(tokens), dtype=np.int64), shares=shares, overhead=overheads)
    # Blocks are balanced on what a block's busiest rank does at fixed SP under the true head split
    # (attention × p × the largest head share at p: 8/7 for 28 heads at p = 8), not on L² + c·L.
    weight = block_size * items.busiest_share(block_size)
    fixed_values = np.stack([values[0] + (weight - 1) * values[1], values[1], values[2]])
    blocks = partition_blocks(replace(items, values=fixed_values), num_blocks, block_size, token_cap,
                              options.refine_steps, options.balance_tolerance / 2, options.attention_goal)
    best = _split_partition(items, blocks, block_size, world_size, token_cap, options)
    # Fixed SP's own partition (LPT on cost over the p-blocks), where fixed SP at p on it beats the
    # plan so far by more than the tolerance: the partition's refinement cannot always reach it (its
    # moves keep attention under the start's peak), and a split of it is never worse than fixed SP
    # on it (the fallback). Its split wins only where it beats the plan by more than the tolerance
    # too (less is not worth the partition's better attention), so the plan's busiest rank stays
    # within (1 + balance_tolerance)² of fixed SP at p on fixed SP's own partition.
    lpt = lpt_groups(values[0], num_blocks)
    if np.bincount(lpt, weights=tokens, minlength=num_blocks).max() <= token_cap * block_size:
        items.degrees[:], items.starts[:] = block_size, lpt * block_size
        fixed_sp_busiest = float(rank_costs(items, np.arange(len(tokens)), 0, world_size).max())
        if fixed_sp_busiest * (1 + options.balance_tolerance) < best[0]:
            other = _split_partition(items, lpt, block_size, world_size, token_cap, options)
            best = other if other[0] * (1 + options.balance_tolerance) < best[0] else best
    return best[1], best[2]


def _split_partition(items: Items, blocks: np.ndarray, block_size: int, world_size: int, token_cap: float,
                     options: PlannerOptions) -> tuple[float, np.ndarray, np.ndarray]:
    """(busiest rank's cost, degrees, starts) of the best split of the p-block partition `blocks`
    over the rooms of `_rooms`, tightest first; fixed SP at p on the partition is the fallback."""
    num_blocks = world_size // block_size
    order = np.argsort(-items.values[0], kind="stable")
    by_block = order[np.argsort(blocks[order], kind="stable")]
    bounds = np.searchsorted(blocks[by_block], np.arange(num_blocks + 1))
    members = [by_block[bounds[b]:bounds[b + 1]].tolist() for b in range(num_blocks)]
    items.degrees[:], items.starts[:] = block_size, blocks * block_size  # fixed SP at p on this partition
    every = np.arange(len(blocks))
    short = items.values[2] < options.min_shard_tokens
    # The fallback shards every sequence at p: short ones only pay off beyond short_tolerance.
    slack = options.short_tolerance if short.any() else options.balance_tolerance
    best = (float(rank_costs(items, every, 0, world_size).max()), items.degrees.copy(), items.starts.copy())
    for room in _rooms(items, blocks, num_blocks, block_size, world_size, token_cap, options):
        items.degrees[:], items.starts[:] = 1, 0
        items.pinned[:] = short
        for block in range(num_blocks):
            _split_p_block(items, members[block], block * block_size, block_size, room, options)
        busiest = float(rank_costs(items, every, 0, world_size).max())
        if busiest <= best[0] * (1 + slack):  # less sharding within the tolerance
            best = (busiest, items.degrees.copy(), items.starts.copy())
        if busiest <= room[0] * (1 + 1e-9):
            break  # the tightest room was met: no looser one can do better
    return best


def _rooms(items: Items, blocks: np.ndarray, num_blocks: int, block_size: int, world_size: int,
           token_cap: float, options: PlannerOptions) -> list[tuple[float, float, float]]:
    """Per-rank rooms (cost, attention, tokens) to split under, tightest first: the busiest block ÷ p
    (an even split of every block, reachable where heads split evenly), then what fixed SP at p
    reaches under the true head split (the busiest rank of a degree-p group: linear ÷ p + attention
    × its head share + the degree-p overheads); both × (1 + balance_tolerance)."""
    values = items.values
    sums = np.stack([np.bincount(blocks, weights=row, minlength=num_blocks) for row in values])
    tolerance = 1 + options.balance_tolerance
    goal = options.attention_goal * float(values[1].sum()) / world_size
    share = items.busiest_share(block_size)
    extra = items.overhead.get(block_size, np.zeros(values.shape[1]))
    fixed = (sums[0] - sums[1]) / block_size + sums[1] * share + np.bincount(blocks, weights=extra,
                                                                               minlength=num_blocks)
    rooms = [(float(sums[0].max()) / block_size * tolerance,
              max(float(sums[1].max()) / block_size * tolerance, goal), token_cap),
             (float(fixed.max()) * tolerance, max(float(sums[1].max()) * share * tolerance, goal), token_cap)]
    return rooms if rooms[1][0] > rooms[0][0] * (1 + 1e-9) else rooms[:1]


def _split_p_block(items: Items, members: list[int], first: int, block_size: int,
                   room: tuple[float, float, float], options: PlannerOptions) -> None:
    """Split one p-block, keeping short sequences whole where they carry at least `short_share`
    of its cost and that leaves its busiest rank within `short_tolerance` of the block split with
    every sequence shardable; otherwise every sequence is shardable."""
    pinned = items.pinned[members]
    share = float(items.values[0, members][pinned].sum()) / max(float(items.values[0, members].sum()), 1e-30)
    if share < options.short_share:
        items.pinned[members] = False
    split_block(items, members, first, block_size, room)
    if not items.pinned[members].any():
        return
    kept = _busiest(items, members, first, block_size)
    if kept <= room[0]:
        return
    whole = (items.degrees[members].copy(), items.starts[members].copy())
    items.pinned[members] = False
    split_block(items, members, first, block_size, room)
    if kept <= _busiest(items, members, first, block_size) * (1 + options.short_tolerance):
        items.degrees[members], items.starts[members] = whole


def _busiest(items: Items, members: list[int], first: int, block_size: int) -> float:
    """Cost of the busiest rank of the block [first, first + block_size) holding `members`."""
    return float(rank_costs(items, members, first, block_size).max())


def plan_step(workload: Workload, world_size: int, cost: CostModel, sp: SPConfig,
              options: PlannerOptions | None = None) -> PlanResult:
    """Plan one step of one SP domain of `world_size` ranks (see the module docstring)."""
    options = options or PlannerOptions()
    allowed = allowed_degrees(world_size, sp, cost, options.head_rule)
    limits = packing_limits(sp.h_pack, sp.H_pack)
    planned, dropped, truncated = apply_oversize(workload, sp, allowed[-1])
    if not planned.sequences:  # every rank idles (it still runs each module once on a placeholder token)
        metrics = idle_metrics()
        plan = Plan(world_size, sp.p_max, (), {rank: () for rank in range(world_size)},
                    _plan_extra(metrics, world_size, cost, sp, options, allowed, limits, dropped, truncated))
        return PlanResult(plan, planned, metrics, dropped, truncated, limits)
    tokens = np.array([s.tokens for s in planned.sequences], dtype=float)
    token_cap = float(sp.max_tokens_per_rank) if sp.max_tokens_per_rank is not None else float("inf")
    if tokens.sum() > token_cap * world_size:
        raise StepOverflowError(
            f"max_tokens_per_rank={sp.max_tokens_per_rank}: the step's {int(tokens.sum())} tokens exceed "
            f"{world_size} ranks × the cap")
    terms = objective_terms(tokens, cost, allowed, sp.overlap, limits)
    try:
        degrees, starts = nested_layout(tokens, cost.c, allowed, world_size, token_cap, options,
                                        (cost.num_heads, cost.num_kv_heads), terms)
    except CapacityError as error:
        seq = planned.sequences[error.args[0]]
        raise StepOverflowError(
            f"sequence {seq.id!r}: no group of ranks has room for its {seq.tokens} tokens under "
            f"max_tokens_per_rank={sp.max_tokens_per_rank}") from None
    packed = step = None
    if cost.step is not None:
        degrees, starts = _least_of_layouts((degrees, starts), tokens, world_size, token_cap, cost, limits, allowed,
                                            options, terms, sp.overlap)
        degrees, starts, packed, step = _least_modelled_time(planned, tokens, degrees, starts, world_size, sp, cost,
                                                       limits, allowed, terms[0][0], token_cap)
    plan = build_plan(planned.sequences, degrees, starts, world_size, sp.p_max, limits,
                      (cost.num_heads, cost.num_kv_heads), packed=packed)
    metrics = compute_metrics(tokens, degrees, starts, world_size=world_size, p_max=allowed[-1],
                              c=cost.c, num_packs=len(plan.packs), num_heads=cost.num_heads,
                              num_kv_heads=cost.num_kv_heads)
    if step is not None:
        metrics = replace(metrics, **step.summary())  # type: ignore[arg-type]
    else:
        metrics = with_step_time(metrics, plan, planned, cost, sp.overlap)
    plan = replace(plan, extra=_plan_extra(metrics, world_size, cost, sp, options, allowed, limits, dropped, truncated))
    return PlanResult(plan, planned, metrics, dropped, truncated, limits)


def _plan_extra(metrics: PlanMetrics, world_size: int, cost: CostModel, sp: SPConfig, options: PlannerOptions,
                allowed: tuple[int, ...], limits: PackingLimits, dropped, truncated) -> dict:
    """The plan file's fields besides packs and rank order: metrics, cost model, options."""
    return {"metrics": metrics.summary(), "cost_model": {
                "name": cost.name, "c": cost.c, "num_heads": cost.num_heads, "num_kv_heads": cost.num_kv_heads,
                "calibration": cost.calibration.source if cost.calibration is not None else None},
            "degree_cap": degree_cap(world_size, sp, cost, allowed),
            "h_pack": limits.h_pack, "H_pack": limits.H_pack, "head_rule": options.head_rule,
            "dropped": list(dropped), "truncated": {k: v[1] for k, v in truncated.items()}}


def idle_metrics() -> PlanMetrics:
    """The metrics of a plan without sequences: nothing to balance."""
    return PlanMetrics(attention_balance=1.0, cost_balance=1.0, token_balance=1.0, efficiency=1.0,
                       lower_bound=0.0, max_rank_cost=0.0, max_rank_tokens=0.0, degree_histogram={},
                       num_packs=0, all_to_all_volume=0.0, all_to_all_relative=0.0)


def _least_of_layouts(nested: tuple[np.ndarray, np.ndarray], tokens: np.ndarray, world_size: int,
                      token_cap: float, cost: CostModel, limits: PackingLimits, allowed: tuple[int, ...],
                      options: PlannerOptions, terms, overlap: bool) -> tuple[np.ndarray, np.ndarray]:
    """The layout of least modelled step time among the calibrated nested layout (first: it wins
    ties), the nested layout the FLOP formula plans (what `plan_step` gives without a calibration)
    and the greedy layout (planning/layouts.py), each packed and scored exactly. The objective's
    per-sequence overheads are a proxy, so neither nested layout is always the better; scoring
    both and the greedy makes the chosen plan never worse, under the model, than either of them."""
    heads = (cost.num_heads, cost.num_kv_heads)
    lengths = tokens.astype(np.int64).tolist()
    shares = {d: head_shares(*heads, d) for d in allowed}
    candidates = [nested, greedy_layout(terms[0], terms[1], shares, allowed, world_size, token_cap,
                                        options.min_shard_tokens)]
    try:
        formula_c = cost.shapes.params_per_layer() / cost.shapes.hidden_size
        candidates.insert(1, nested_layout(tokens, formula_c, allowed, world_size, token_cap, options, heads))
    except CapacityError:
        pass  # the formula's layout found no room where the calibrated one did: not a candidate
    best = None
    for layout in candidates:
        if layout is None:
            continue
        seconds = layout_step_time(lengths, *layout, world_size, limits, cost, overlap).step_s
        if best is None or seconds < best[0] * (1 - 1e-9):
            best = (seconds, layout)
    return best[1]


def _least_modelled_time(planned: Workload, tokens: np.ndarray, degrees: np.ndarray, starts: np.ndarray,
                         world_size: int, sp: SPConfig, cost: CostModel, limits: PackingLimits,
                         allowed: tuple[int, ...], weight: np.ndarray, token_cap: float
                         ) -> tuple[np.ndarray, np.ndarray, list, StepTime]:
    """The layout with the least modelled step time (packed, in HSF order: planning/step_time.py)
    among the given layout (`_least_of_layouts`' choice) and fixed SP at every allowed degree (LPT
    over its groups on the calibrated cost) that fits the token cap: the layout's per-sequence
    overheads are a proxy, so the exact model has the last word. Each
    candidate is scored on its packs as arrays (`layout_step_time`), without building a Plan.
    `weight`: the calibrated cost of each sequence (LPT's weight). Returns (degrees, starts,
    `packed_groups`, modelled step time) of the winner."""
    lengths = [s.tokens for s in planned.sequences]
    packed = list(packed_groups(degrees, starts, lengths, limits))
    step = layout_step_time(lengths, degrees, starts, world_size, limits, cost, sp.overlap, packed)
    best = (step.step_s, (degrees, starts, packed, step))
    for degree in allowed:
        # Skipping a candidate whose lower bound cannot beat the best keeps the choice exact.
        if fixed_sp_time_floor(tokens, degree, world_size, cost, limits) * (1 - 1e-12) >= best[0] * (1 - 1e-9):
            continue
        groups = lpt_groups(weight, world_size // degree)
        held = np.bincount(groups, weights=tokens, minlength=world_size // degree) / degree
        if held.max() > token_cap:
            continue
        if fixed_sp_time_floor(tokens, degree, world_size, cost, limits, groups) * (1 - 1e-12) >= best[0] * (1 - 1e-9):
            continue
        layout = (np.full(len(tokens), degree, dtype=np.int64), groups * degree)
        packed = list(packed_groups(*layout, lengths, limits))
        step = layout_step_time(lengths, *layout, world_size, limits, cost, sp.overlap, packed)
        if step.step_s < best[0] * (1 - 1e-9):
            best = (step.step_s, (*layout, packed, step))
    return best[1]


def build_plan(sequences: tuple[SequenceSpec, ...], degrees: np.ndarray, starts: np.ndarray,
               world_size: int, p_max: int, limits: PackingLimits, heads: tuple[int, int] | None = None,
               packed: list | None = None) -> Plan:
    """Group sequences by block, pack them, number packs in HSF order, derive rank_order; with
    `heads` (query, KV) every pack records the query heads each of its ranks holds. `packed`: the
    layout's `packed_groups`, if already computed."""
    tokens = [s.tokens for s in sequences]
    ids = [s.id for s in sequences]
    packs: list[Pack] = []
    heads_of: dict[int, tuple[int, ...]] = {}
    for degree, start, pack_members in packed or packed_groups(degrees, starts, tokens, limits):
        if degree not in heads_of:
            heads_of[degree] = heads_per_rank(*heads, degree) if heads else ()
        packs.append(Pack(len(packs), degree, tuple(range(start, start + degree)),
                          tuple([ids[i] for i in pack_members]), heads_of[degree]))
    assert [p.id for p in sorted(packs, key=hsf_key)] == list(range(len(packs)))
    order: dict[int, list[int]] = {rank: [] for rank in range(world_size)}
    for pack in packs:  # already in HSF order (asserted): each rank's restriction of it
        for rank in pack.ranks:
            order[rank].append(pack.id)
    return Plan(world_size=world_size, p_max=p_max, packs=tuple(packs),
                rank_order={rank: tuple(ids) for rank, ids in order.items()})
