"""FlexUlysses planner: per-step degrees, aligned groups, packs and HSF order. Pure (numpy only).

Public API (stable; the executor calls it once per step and SP domain):

    result = plan_step(workload, world_size, cost_model, sp_config)   # -> PlanResult
    result.plan        # Plan: packs on aligned blocks + HSF rank_order (plan-schema.md)
    result.workload    # the workload actually planned (after oversize drop/truncate)
    result.dropped / result.truncated / result.metrics

Algorithm (docs/ARCHITECTURE.md "Planner" has the argument; p = the largest allowed degree):
1. Every sequence of degree ≤ p lies in one aligned p-block, so a plan is first a partition of the
   sequences over the W/p p-blocks. `partition_blocks` (placement.py): LPT on cost (exactly fixed
   SP at p's) and a 2-D LPT (attention-heavy sequences by max(cost, attention)), each refined by
   moves/swaps on cost, then on attention under a cost ceiling; least attention among those within
   `balance_tolerance / 2` of the best busiest-block cost; if its attention is above the goal,
   2-for-1 exchanges between blocks lower it without raising the busiest block's cost.
   *Attention repair* (attention_repair.py), only where a block's attention is still above
   `attention_target` ÷ (1 + balance_tolerance) × its mean and the attention partition bound is
   below that: one-for-many exchanges (a long item for a block's shortest items) with block cost
   allowed up to (1 + `attention_repair_slack`) × the busiest block's, raised in stages. Where a
   block is still above that goal, the *attention-first search* (attention_search.py: LPT on
   attention for the long sequences, short ones filling the attention-tight blocks, then a
   penalty descent by moves/swaps; bounded by counted work, any step size) replaces the partition
   if it meets the goal with every block's cost ≤ max(busiest block before,
   `attention_search_cost_cap` × mean block), caps tried in stages — unless
   `metrics.attention_cost_infeasible` proves that no partition meets both.
2. Per-rank rooms: cost `(1 + balance_tolerance) ×` busiest block ÷ p (what fixed SP at p reaches
   on this partition), attention `max((1 + balance_tolerance) × busiest block ÷ p,
   attention_goal × mean)`, tokens `max_tokens_per_rank`.
3. Each p-block is split by recursive halving (`split_block`): the k largest shardable sequences
   stay at the block's degree, the rest go to the two halves (greedy + move/swap repair) so both fit
   the rooms left; smallest such k; recurse. Degrees are thus chosen by the layout: a sequence is
   sharded only as far as balance or the token cap needs. Sequences under `min_shard_tokens` stay
   whole where they carry ≥ `short_share` of a block's cost and that costs ≤ `short_tolerance`.
4. Pack sequences sharing a group (packing.py); number packs in HSF order (schedule.py).
Guarantee (no token cap, no short sequences kept whole): busiest rank ≤ (1 + tolerance)² × fixed
SP at p's, so efficiency ≥ fixed SP's − 2·tolerance; attention balance ≤ max(fixed SP's ×
(1 + tolerance), attention_goal) unless the 2-D start wins on cost; all-to-all ≤ fixed SP's.
Where the attention repair runs, the busiest rank may rise by up to a further factor
(1 + attention_repair_slack) (efficiency ≥ fixed SP's ÷ (1 + slack) − 2·tolerance), and where
it reaches its block goal the split's attention room, (1 + tolerance) × busiest block ÷ p, keeps
attention balance ≤ attention_target (a soft room: exceeded only where pinned short sequences
leave no choice). Where the attention-first search's partition is taken, the busiest rank is
≤ (1 + tolerance)² × max(busiest block before, attention_search_cost_cap × mean block) ÷ p
(cost balance ≤ ~1.03 where the schema's lower bound is the mean; efficiency ≥ 1/1.03 − 2·tol).

Head rule (`PlannerOptions.head_rule`): Ulysses scatters query heads over the group. "uneven"
(default) allows every power-of-two degree ≤ min(p_max, num_heads) (every rank needs a query head;
the plan's `degree_cap` says which limit bound); when d does not divide num_heads the executor
uses an uneven-heads all-to-all (some ranks get one more head: planning/heads.py). "divisible" only allows degrees that
divide num_heads (Qwen2.5-VL-7B: 28 heads → at most 4). KV heads fewer than d are replicated so each
rank holds the KV heads its query heads use; KV heads more than d are scattered like query heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import CostModel
from flexrl_ds.planning.heads import heads_per_rank, max_degree_for_heads
from flexrl_ds.planning.attention_repair import repair_attention
from flexrl_ds.planning.attention_search import search_partition
from flexrl_ds.planning.metrics import (PlanMetrics, attention_cost_infeasible, compute_metrics, head_shares,
                                        partition_bound)
from flexrl_ds.planning.packing import PackingLimits, pack_group, packing_limits
from flexrl_ds.planning.placement import partition_blocks
from flexrl_ds.planning.split import CapacityError, Items, rank_costs, split_block
from flexrl_ds.planning.plan import Pack, Plan, SequenceSpec, Workload, is_power_of_two
from flexrl_ds.planning.schedule import hsf_key, hsf_rank_order


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
    attention_target: float = 1.05
    """Attention balance the repair phase aims for: where the block partition leaves a p-block's
    attention above this ÷ (1 + balance_tolerance) (the split's margin) × the mean block and the
    attention partition bound is below that, one-for-many exchanges lower it
    (attention_repair.py). float("inf") turns the repair off."""
    attention_repair_slack: float = 0.01
    """The repair may raise a p-block's cost up to (1 + this) × the busiest block's cost (in
    stages: a quarter, half, all of it, only as far as attention needs)."""
    attention_repair_steps: int = 96
    """Upper bound on the repair's exchanges (a round, one vectorised search of ~1–3 ms on the
    2-core box, makes up to one per p-block)."""
    attention_search_cost_cap: float = 1.03
    """Where the repair still leaves a block above its attention goal, an attention-first search
    (bounded by attention_search.WORK_BUDGET counted candidates) may raise the busiest p-block's
    cost up to this × the mean block cost (never lowering the cap below the busiest block's cost
    before the search); 0 turns the search off."""

    def __post_init__(self) -> None:
        if not self.attention_target > 0:
            raise ValueError(f"attention_target must be positive, got {self.attention_target!r}")
        if not 0 <= self.attention_repair_slack < float("inf"):
            raise ValueError(f"attention_repair_slack must be ≥ 0 and finite, got {self.attention_repair_slack!r}")
        steps = self.attention_repair_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"attention_repair_steps must be a non-negative integer, got {steps!r}")
        if not 0 <= self.attention_search_cost_cap < float("inf"):
            raise ValueError(
                f"attention_search_cost_cap must be ≥ 0 and finite, got {self.attention_search_cost_cap!r}")


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
                f"max_tokens_per_rank={cap} (set oversize to drop or truncate)")
        elif sp.oversize == "drop":
            dropped.append(seq.id)
        else:
            truncated[seq.id] = (seq.tokens, limit)
            kept.append(replace(seq, tokens=limit, vision_tokens=min(seq.vision_tokens, limit)))
    if not kept:
        raise ValueError(f"every sequence exceeds max_tokens_per_rank={cap} × {max_degree}; nothing to plan")
    return Workload(tuple(kept)), tuple(dropped), truncated


def nested_layout(tokens: np.ndarray, c: float, allowed: tuple[int, ...], world_size: int, token_cap: float,
                  options: PlannerOptions, heads: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(degree, first rank) of every sequence: p-block partition, then recursive halving under
    per-rank rooms (placement.py, split.py; module docstring). `heads` (query, KV): each rank is
    costed by the query heads it holds (planning/heads.py); None: an even split."""
    block_size = allowed[-1]
    assert allowed == tuple(1 << k for k in range(len(allowed))), allowed  # a prefix of powers of two
    num_blocks = world_size // block_size
    values = np.stack([tokens * tokens + c * tokens, tokens * tokens, tokens])
    shares = {d: head_shares(*(heads or (None, None)), d) for d in allowed}
    items = Items(values, tokens < options.min_shard_tokens, np.ones(len(tokens), dtype=np.int64),
                  np.zeros(len(tokens), dtype=np.int64), shares=shares)
    # Blocks are balanced on what a block's busiest rank does at fixed SP under the true head split
    # (attention × p × the largest head share at p: 8/7 for 28 heads at p = 8), not on L² + c·L.
    weight = block_size * items.busiest_share(block_size)
    fixed_values = np.stack([values[0] + (weight - 1) * values[1], values[1], values[2]])
    blocks = partition_blocks(replace(items, values=fixed_values), num_blocks, block_size, token_cap,
                              options.refine_steps, options.balance_tolerance / 2, options.attention_goal)
    _repair_blocks(values, blocks, num_blocks, block_size * token_cap, options)
    order = np.argsort(-values[0], kind="stable")
    by_block = order[np.argsort(blocks[order], kind="stable")]
    bounds = np.searchsorted(blocks[by_block], np.arange(num_blocks + 1))
    members = [by_block[bounds[b]:bounds[b + 1]].tolist() for b in range(num_blocks)]
    items.degrees[:], items.starts[:] = block_size, blocks * block_size  # fixed SP at p on this partition
    every = np.arange(len(tokens))
    # The fallback shards every sequence at p: short ones only pay off beyond short_tolerance.
    slack = options.short_tolerance if items.pinned.any() else options.balance_tolerance
    best = (float(rank_costs(items, every, 0, world_size).max()), items.degrees.copy(), items.starts.copy())
    for room in _rooms(items, blocks, num_blocks, block_size, world_size, token_cap, options):
        items.degrees[:], items.starts[:] = 1, 0
        items.pinned[:] = tokens < options.min_shard_tokens
        for block in range(num_blocks):
            _split_p_block(items, members[block], block * block_size, block_size, room, options)
        busiest = float(rank_costs(items, every, 0, world_size).max())
        if busiest <= best[0] * (1 + slack):  # less sharding within the tolerance
            best = (busiest, items.degrees.copy(), items.starts.copy())
        if busiest <= room[0] * (1 + 1e-9):
            break  # the tightest room was met: no looser one can do better
    return best[1], best[2]


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


def _repair_blocks(values: np.ndarray, blocks: np.ndarray, num_blocks: int, token_room: float,
                   options: PlannerOptions) -> None:
    """Attention repair of the block partition (attention_repair.py), only where the busiest
    block's attention is above the target and the partition bound is below it."""
    goal = options.attention_target / (1 + options.balance_tolerance) * float(values[1].sum()) / num_blocks
    if num_blocks < 2 or np.bincount(blocks, weights=values[1], minlength=num_blocks).max() <= goal:
        return
    if partition_bound(values[1], num_blocks) >= goal:
        return
    cost_start = float(np.bincount(blocks, weights=values[0], minlength=num_blocks).max())
    repair_attention(values, blocks, num_blocks, token_room, options.attention_repair_slack, goal,
                     options.attention_repair_steps)
    if options.attention_search_cost_cap <= 0 or \
            np.bincount(blocks, weights=values[1], minlength=num_blocks).max() <= goal:
        return
    cost_cap = max(cost_start, options.attention_search_cost_cap * float(values[0].sum()) / num_blocks)
    if attention_cost_infeasible(values[0], values[1], num_blocks, goal, cost_cap):
        return  # no partition meets both caps: the search could only spend its budget
    found = search_partition(values, num_blocks, token_room, goal, cost_start, cost_cap)
    if found is not None:
        blocks[:] = found


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
    tokens = np.array([s.tokens for s in planned.sequences], dtype=float)
    token_cap = float(sp.max_tokens_per_rank) if sp.max_tokens_per_rank is not None else float("inf")
    if tokens.sum() > token_cap * world_size:
        raise ValueError(
            f"max_tokens_per_rank={sp.max_tokens_per_rank}: the step's {int(tokens.sum())} tokens exceed "
            f"{world_size} ranks × the cap")
    try:
        degrees, starts = nested_layout(tokens, cost.c, allowed, world_size, token_cap, options,
                                        (cost.num_heads, cost.num_kv_heads))
    except CapacityError as error:
        seq = planned.sequences[error.args[0]]
        raise ValueError(
            f"sequence {seq.id!r}: no group of ranks has room for its {seq.tokens} tokens under "
            f"max_tokens_per_rank={sp.max_tokens_per_rank}") from None
    plan = build_plan(planned.sequences, degrees, starts, world_size, sp.p_max, limits,
                      (cost.num_heads, cost.num_kv_heads))
    metrics = compute_metrics(tokens, degrees, starts, world_size=world_size, p_max=allowed[-1],
                              c=cost.c, num_packs=len(plan.packs), num_heads=cost.num_heads,
                              num_kv_heads=cost.num_kv_heads)
    extra = {"metrics": metrics.summary(), "cost_model": {"name": cost.name, "c": cost.c},
             "degree_cap": degree_cap(world_size, sp, cost, allowed),
             "h_pack": limits.h_pack, "H_pack": limits.H_pack, "head_rule": options.head_rule,
             "dropped": list(dropped), "truncated": {k: v[1] for k, v in truncated.items()}}
    plan = replace(plan, extra=extra)
    return PlanResult(plan, planned, metrics, dropped, truncated, limits)


def build_plan(sequences: tuple[SequenceSpec, ...], degrees: np.ndarray, starts: np.ndarray,
               world_size: int, p_max: int, limits: PackingLimits, heads: tuple[int, int] | None = None) -> Plan:
    """Group sequences by block, pack them, number packs in HSF order, derive rank_order; with
    `heads` (query, KV) every pack records the query heads each of its ranks holds."""
    groups: dict[tuple[int, int], list[int]] = {}
    for index, (degree, start) in enumerate(zip(degrees.tolist(), starts.tolist())):
        groups.setdefault((degree, start), []).append(index)
    tokens = [s.tokens for s in sequences]
    ids = [s.id for s in sequences]
    packs: list[Pack] = []
    for (degree, start), members in sorted(groups.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        ranks = tuple(range(start, start + degree))
        for pack_members in pack_group(members, tokens, limits):
            held = heads_per_rank(*heads, degree) if heads else ()
            packs.append(Pack(len(packs), degree, ranks, tuple([ids[i] for i in pack_members]), held))
    assert [p.id for p in sorted(packs, key=hsf_key)] == list(range(len(packs)))
    return Plan(world_size=world_size, p_max=p_max, packs=tuple(packs),
                rank_order=hsf_rank_order(packs, world_size))
