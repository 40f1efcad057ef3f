"""FlexUlysses planner: per-step degrees, aligned groups, packs and HSF order. Pure (numpy only).

Public API (stable; the executor calls it once per step and SP domain):

    result = plan_step(workload, world_size, cost_model, sp_config)   # -> PlanResult
    result.plan        # Plan: packs on aligned blocks + HSF rank_order (plan-schema.md)
    result.workload    # the workload actually planned (after oversize drop/truncate)
    result.dropped / result.truncated / result.metrics

Algorithm (docs/ARCHITECTURE.md "Planner" has the argument):
1. Lower bounds `LBc = max(Σ cost / W, max cost / p)` and `LBa` (same with attention L²), p the
   largest allowed degree.
2. Candidates (`PlannerOptions.tries`): cost-only at θ = 1, then attention-aware at θ = ¼, ⅛,
   1/16, ½. A sequence gets the smallest allowed degree d with `cost/d ≤ θ·LBc` (attention-aware: also
   `L²/d ≤ θ·LBa`) and `L/d ≤ max_tokens_per_rank` — only what balance or memory needs.
3. Each candidate: LPT on aligned blocks (placement.py), then moves/swaps off the busiest rank.
4. Stop at the first candidate within `balance_tolerance` of LBc whose attention balance is at most
   `attention_goal`. Otherwise: among candidates within tolerance of the best busiest-rank cost, the
   least all-to-all volume that meets the attention goal, else the lowest busiest-rank cost.
5. Pack sequences sharing a group (packing.py); number packs in HSF order (schedule.py).

Head rule (`PlannerOptions.head_rule`): Ulysses scatters query heads over the group. "uneven"
(default) allows every power-of-two degree ≤ p_max; when d does not divide num_heads the executor
uses an uneven-heads all-to-all (some ranks get one more head). "divisible" only allows degrees that
divide num_heads (Qwen2.5-VL-7B: 28 heads → at most 4). KV heads fewer than d are replicated so each
rank holds the KV heads its query heads use; KV heads more than d are scattered like query heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from flexrl_ds.config.flexrl_config import SPConfig
from flexrl_ds.sp.cost_model import CostModel
from flexrl_ds.sp.metrics import PlanMetrics, compute_metrics, rank_sums
from flexrl_ds.sp.packing import PackingLimits, pack_group, packing_limits
from flexrl_ds.sp.placement import CapacityError, Layout, place_lpt, refine, refine_attention
from flexrl_ds.sp.plan import Pack, Plan, SequenceSpec, Workload, is_power_of_two
from flexrl_ds.sp.schedule import hsf_key, hsf_rank_order


@dataclass(frozen=True)
class PlannerOptions:
    """Knobs of the planner beyond SPConfig (defaults are what the benchmarks use)."""

    head_rule: str = "uneven"
    """"uneven": any power-of-two degree (uneven-heads all-to-all); "divisible": d | num_heads."""
    tries: tuple[tuple[float, bool], ...] = ((1.0, False), (0.25, True), (0.125, True), (0.0625, True),
                                            (0.5, True))
    """Candidates in the order tried: (θ, attention-aware). A sequence is sharded until
    cost/d ≤ θ·LBc (and, attention-aware, L²/d ≤ θ·LBa); smaller θ shards more. The first candidate
    meeting both goals is taken, so the order trades planning time against all-to-all volume
    (θ = ¼ first: on the benchmark grid it meets the goals most often; θ = ½ last: when ¼ misses the
    attention goal, sharding less rarely reaches it)."""
    balance_tolerance: float = 0.01
    """Prefer less sharding if its busiest rank is within this fraction of the best candidate's."""
    refine_steps: int = 48
    """Upper bound on move/swap steps of the local refinement."""
    attention_goal: float = 1.05
    """Attention balance the search tries to reach (by sharding more) once cost is balanced."""


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
    """Powers of two ≤ min(p_max, world_size), filtered by the head rule; validates world_size/p_max."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not is_power_of_two(sp.p_max):
        raise ValueError(f"p_max {sp.p_max} is not a power of two")
    p_eff = min(sp.p_max, world_size)
    if not is_power_of_two(p_eff) or world_size % p_eff:
        raise ValueError(f"world_size {world_size} is not a multiple of the group size p_max={sp.p_max}")
    if head_rule not in HEAD_RULES:
        raise ValueError(f"head_rule {head_rule!r} is not one of {', '.join(HEAD_RULES)}")
    degrees = [1 << k for k in range(p_eff.bit_length()) if (1 << k) <= p_eff]
    if head_rule == "divisible":
        degrees = [d for d in degrees if cost.num_heads % d == 0]
    return tuple(degrees)


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


def choose_degrees(values: tuple[np.ndarray, ...], targets: tuple[float, ...], tokens: np.ndarray,
                   allowed: tuple[int, ...], token_cap: float) -> np.ndarray:
    """Smallest allowed degree with value/d ≤ target for every (value, target) pair and
    tokens/d ≤ cap; the largest allowed degree where none does."""
    degrees = np.full(len(tokens), allowed[-1], dtype=np.int64)
    undecided = np.ones(len(tokens), dtype=bool)
    for degree in allowed:
        fits = undecided & (tokens / degree <= token_cap)
        for value, target in zip(values, targets):
            fits &= value / degree <= target
        degrees[fits] = degree
        undecided &= ~fits
    return degrees


@dataclass
class _Candidate:
    max_cost: float
    attention_balance: float
    volume: float
    layout: Layout


def _try(tokens: np.ndarray, costs: np.ndarray, attention: np.ndarray, degrees: np.ndarray,
         attention_aware: bool, bounds: tuple[float, float], allowed: tuple[int, ...], world_size: int,
         token_cap: float, options: PlannerOptions) -> _Candidate:
    cost_bound, attn_bound = bounds
    layout = Layout(degrees, costs, attention, tokens, np.zeros(len(tokens), dtype=np.int64))
    place_lpt(layout, world_size=world_size, token_cap=token_cap, allowed=allowed,
              cost_target=cost_bound, attn_target=attn_bound if attention_aware else None)
    refine(layout, world_size=world_size, token_cap=token_cap, max_steps=options.refine_steps, allowed=allowed,
           good_enough=cost_bound * (1 + options.balance_tolerance / 2))
    refine_attention(layout, world_size=world_size, token_cap=token_cap, max_steps=options.refine_steps // 2,
                     cost_ceiling=cost_bound * (1 + options.balance_tolerance / 2), goal=options.attention_goal)
    rank_cost = rank_sums(costs, layout.degrees, layout.starts, world_size)
    rank_attn = rank_sums(attention, layout.degrees, layout.starts, world_size)
    mean_attn = float(rank_attn.mean())
    volume = float((tokens * (layout.degrees - 1) / layout.degrees).sum())
    return _Candidate(float(rank_cost.max()), float(rank_attn.max()) / mean_attn if mean_attn else 1.0,
                      volume, layout)


def _search(tokens: np.ndarray, cost: CostModel, allowed: tuple[int, ...], world_size: int,
            token_cap: float, options: PlannerOptions) -> Layout:
    """Try θ × (cost-only, attention-aware) from least to most sharding; keep the best (module doc)."""
    costs = tokens * tokens + cost.c * tokens
    attention = tokens * tokens
    bounds = (max(float(costs.sum()) / world_size, float(costs.max()) / allowed[-1]),
              max(float(attention.sum()) / world_size, float(attention.max()) / allowed[-1]))
    tried: list[_Candidate] = []
    seen: set[bytes] = set()
    for theta, attention_aware in options.tries:
        targets = (theta * bounds[0], theta * bounds[1]) if attention_aware else (theta * bounds[0],)
        degrees = choose_degrees((costs, attention)[:len(targets)], targets, tokens, allowed, token_cap)
        key = degrees.tobytes()  # same degrees place alike: attention only steers sharded ones
        if key in seen:
            continue
        seen.add(key)
        found = _try(tokens, costs, attention, degrees, attention_aware, bounds, allowed, world_size,
                     token_cap, options)
        tried.append(found)
        if found.max_cost <= bounds[0] * (1 + options.balance_tolerance) \
                and found.attention_balance <= options.attention_goal:
            return found.layout
    best_cost = min(c.max_cost for c in tried)
    good = [c for c in tried if c.max_cost <= best_cost * (1 + options.balance_tolerance / 2)]
    balanced = [c for c in good if c.attention_balance <= options.attention_goal]
    if balanced:
        return min(balanced, key=lambda c: (c.volume, c.max_cost)).layout
    # No candidate reaches the attention goal: cost (the time model) decides.
    return min(tried, key=lambda c: (c.max_cost, c.volume)).layout


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
        layout = _search(tokens, cost, allowed, world_size, token_cap, options)
    except CapacityError as error:
        seq = planned.sequences[error.args[0]]
        raise ValueError(
            f"sequence {seq.id!r}: no group of ranks has room for its {seq.tokens} tokens under "
            f"max_tokens_per_rank={sp.max_tokens_per_rank}") from None
    plan = build_plan(planned.sequences, layout.degrees, layout.starts, world_size, sp.p_max, limits)
    metrics = compute_metrics(tokens, layout.degrees, layout.starts, world_size=world_size, p_max=sp.p_max,
                              c=cost.c, num_packs=len(plan.packs))
    extra = {"metrics": metrics.summary(), "cost_model": {"name": cost.name, "c": cost.c},
             "h_pack": limits.h_pack, "H_pack": limits.H_pack, "head_rule": options.head_rule,
             "dropped": list(dropped), "truncated": {k: v[1] for k, v in truncated.items()}}
    plan = replace(plan, extra=extra)
    return PlanResult(plan, planned, metrics, dropped, truncated, limits)


def build_plan(sequences: tuple[SequenceSpec, ...], degrees: np.ndarray, starts: np.ndarray,
               world_size: int, p_max: int, limits: PackingLimits) -> Plan:
    """Group sequences by block, pack them, number packs in HSF order, derive rank_order."""
    groups: dict[tuple[int, int], list[int]] = {}
    for index, (degree, start) in enumerate(zip(degrees.tolist(), starts.tolist())):
        groups.setdefault((degree, start), []).append(index)
    tokens = [s.tokens for s in sequences]
    ids = [s.id for s in sequences]
    packs: list[Pack] = []
    for (degree, start), members in sorted(groups.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        ranks = tuple(range(start, start + degree))
        for pack_members in pack_group(members, tokens, limits):
            packs.append(Pack(len(packs), degree, ranks, tuple([ids[i] for i in pack_members])))
    assert [p.id for p in sorted(packs, key=hsf_key)] == list(range(len(packs)))
    return Plan(world_size=world_size, p_max=p_max, packs=tuple(packs),
                rank_order=hsf_rank_order(packs, world_size))
