"""Balance metrics of a plan (docs/PLAN_SCHEMA.md "Metrics"); pure, numpy only.

Per rank, a sequence of `L` tokens in a pack of degree `d` contributes `L²·h_r/H` attention (h_r of
the model's H query heads on that rank, as the executor splits them; `L²/d` without head counts),
`L²·h_r/H + c·L/d` cost and `L/d` tokens to each rank of its group. A balance ratio is max ÷ mean over
ranks; efficiency is the lower bound `max(Σ cost / W, max_s cost(s) / p_max)` ÷ the max rank cost;
all-to-all volume is `Σ L·(d−1)/d`, also given relative to fixed SP at `p_max` (every sequence
sharded at `min(p_max, W)`).

Bounds (what no plan on aligned groups of at most `p = min(p_max, W)` ranks can beat): every
sequence lies inside one aligned p-block, and the busiest rank of a block carries at least the
block's total ÷ p, so the busiest rank is at least `partition_bound(values, W/p) / p` — a lower
bound on the best split of the sequences' values over W/p bins (`partition_bound`). It also carries
at least any one sequence's share on the rank of its group with the most query heads, at the
degree that makes that share smallest (`busiest_rank_share_floors`; `L²/p` and `cost/p` without
head counts, more where p does not divide the heads: 28 heads at p = 8 give some rank 4/28, not
1/8). With them: `attention_balance_bound = max(mean, own attention, partition_bound(L², W/p)/p) ÷
mean` and `efficiency_bound = lower_bound ÷ max(lower_bound, own cost, partition_bound(cost,
W/p)/p)` (the best efficiency reachable; below 1 where the schema's lower bound is not attainable).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Mapping

import numpy as np

from flexrl_ds.planning.heads import heads_per_rank, kv_heads_held, max_degree_for_heads
from flexrl_ds.planning.plan import Plan
from flexrl_ds.planning.step_time import plan_step_time


@dataclass(frozen=True)
class PlanMetrics:
    """Balance and communication figures of one plan."""

    attention_balance: float
    """max/mean over ranks of Σ L²/d (the paper's metric)."""
    cost_balance: float
    """max/mean over ranks of Σ (L² + c·L)/d."""
    token_balance: float
    """max/mean over ranks of Σ L/d (activation memory)."""
    efficiency: float
    """lower bound ÷ max rank cost; 1.0 is perfect."""
    lower_bound: float
    """max(Σ cost / W, max cost / p_max)."""
    max_rank_cost: float
    """Cost of the busiest rank."""
    max_rank_tokens: float
    """Tokens held by the fullest rank."""
    degree_histogram: dict[int, int]
    """degree -> number of sequences sharded at that degree."""
    num_packs: int
    """Packs in the plan."""
    all_to_all_volume: float
    """Σ L·(d−1)/d tokens moved per all-to-all."""
    all_to_all_relative: float
    """all_to_all_volume ÷ that of fixed SP at p_max (0 when the latter is 0)."""
    attention_balance_bound: float = 1.0
    """Lowest attention balance any aligned plan can reach (module doc); ≤ attention_balance."""
    efficiency_bound: float = 1.0
    """Highest efficiency any aligned plan can reach (module doc); ≥ efficiency."""
    step_time_s: float = 0.0
    """Modelled step time (the busiest rank, planning/step_time.py); 0 without a calibration."""
    compute_s: float = 0.0
    """Linear + attention seconds of the busiest rank (0 without a calibration)."""
    exposed_all_to_all_s: float = 0.0
    """All-to-all seconds of the busiest rank not hidden by overlap (0 without a calibration)."""
    idle_s: float = 0.0
    """Mean seconds a rank waits for the busiest one (0 without a calibration)."""
    mean_compute_s: float = 0.0
    """Mean over ranks of linear + attention seconds (+ mean exposed all-to-all + idle = step time)."""
    mean_exposed_all_to_all_s: float = 0.0
    """Mean over ranks of all-to-all seconds not hidden by overlap."""
    rank_cost: list[float] = field(default_factory=list, repr=False)
    """Per-rank cost (for plots)."""
    rank_attention: list[float] = field(default_factory=list, repr=False)
    """Per-rank attention (for plots)."""
    rank_tokens: list[float] = field(default_factory=list, repr=False)
    """Per-rank tokens (for plots)."""

    def summary(self) -> dict[str, Any]:
        """The scalar fields (what goes into plan files and tables)."""
        skip = ("rank_cost", "rank_attention", "rank_tokens")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        out["degree_histogram"] = {str(k): v for k, v in sorted(self.degree_histogram.items())}
        return out


def head_shares(num_heads: int | None, num_kv_heads: int | None, degree: int) -> np.ndarray:
    """Share of a sequence's attention each rank of a degree-`degree` group does: its query heads
    ÷ all (the executor's split, planning/heads.py); an even 1/d without head counts."""
    if num_heads is None or degree == 1:
        return np.full(degree, 1.0 / degree)
    kv = num_heads if num_kv_heads is None else num_kv_heads
    return np.asarray(heads_per_rank(num_heads, kv, degree), dtype=float) / num_heads


def kv_traffic_factor(num_heads: int | None, num_kv_heads: int | None, degree: int) -> float:
    """All-to-all traffic of a degree-`degree` pack ÷ that without KV replication: q, k, v and the
    output carry 2·H + 2·(KV heads held over the group) head vectors per token instead of 2·H + 2·KV."""
    if num_heads is None or degree == 1:
        return 1.0
    kv = num_heads if num_kv_heads is None else num_kv_heads
    return (2 * num_heads + 2 * kv_heads_held(num_heads, kv, degree)) / (2 * num_heads + 2 * kv)


def rank_head_sums(values: np.ndarray, degrees: np.ndarray, starts: np.ndarray, world_size: int,
                   num_heads: int | None, num_kv_heads: int | None) -> np.ndarray:
    """Per-rank Σ value × the rank's head share (`head_shares`) over items on ranks [start, start+d)."""
    out = np.zeros(world_size)
    values, degrees, starts = np.asarray(values, dtype=float), np.asarray(degrees), np.asarray(starts)
    for degree in np.unique(degrees).tolist():
        on = degrees == degree
        for offset, share in enumerate(head_shares(num_heads, num_kv_heads, int(degree)).tolist()):
            np.add.at(out, starts[on] + offset, values[on] * share)
    return out


def rank_sums(values: np.ndarray, degrees: np.ndarray, starts: np.ndarray, world_size: int) -> np.ndarray:
    """Per-rank Σ value/d over items spread on ranks [start, start+d) (difference-array trick)."""
    diff = np.zeros(world_size + 1)
    share = values / degrees
    np.add.at(diff, starts, share)
    np.add.at(diff, starts + degrees, -share)
    return np.cumsum(diff[:-1])


def partition_bound(values: np.ndarray, num_bins: int) -> float:
    """Lower bound on the largest bin sum of any split of `values` over `num_bins` bins: the
    largest value, and for every k ≥ 1 the k+1 smallest of the k·num_bins + 1 largest values (some
    bin holds k+1 of those)."""
    ranked = np.sort(np.asarray(values, dtype=float))[::-1]
    prefix = np.concatenate([[0.0], np.cumsum(ranked)])
    k = np.arange(1, (len(ranked) - 1) // num_bins + 1)
    bound = float(ranked[0]) if len(ranked) else 0.0
    if len(k):
        bound = max(bound, float((prefix[k * num_bins + 1] - prefix[k * num_bins - k]).max()))
    return bound


def busiest_rank_share_floors(tokens: np.ndarray, c: float, p_max: int, num_heads: int | None,
                              num_kv_heads: int | None) -> tuple[float, float]:
    """Attention and cost that the busiest rank carries at least, from one sequence alone: at
    degree d the group's rank with the most query heads does `max(head_shares) · L²` of its
    attention (+ `c·L/d`), so at best the smallest of those over the degrees d ≤ p_max (and ≤ the
    query heads: every rank of a group holds one). Without head counts, `L²/p_max` and `cost/p_max`."""
    if not len(tokens):
        return 0.0, 0.0
    largest = min(p_max, max_degree_for_heads(num_heads)) if num_heads else p_max  # as compute_metrics caps p
    degrees = [1 << k for k in range(int(largest).bit_length()) if 1 << k <= largest]
    busiest = {d: float(head_shares(num_heads, num_kv_heads, d).max()) for d in degrees}
    attention = tokens * tokens
    own_attention = np.min([busiest[d] * attention for d in degrees], axis=0)
    own_cost = np.min([busiest[d] * attention + c * tokens / d for d in degrees], axis=0)
    return float(own_attention.max()), float(own_cost.max())


def _ratio(loads: np.ndarray) -> float:
    mean = float(loads.mean())
    return float(loads.max()) / mean if mean > 0 else 1.0


def compute_metrics(tokens: np.ndarray, degrees: np.ndarray, starts: np.ndarray, *, world_size: int,
                    p_max: int, c: float, num_packs: int, num_heads: int | None = None,
                    num_kv_heads: int | None = None) -> PlanMetrics:
    """Metrics from per-sequence arrays: tokens L, degree d, first rank of the group. With head
    counts, a rank's attention is L² × its query heads ÷ all (the executor's split, not L²/d) and
    the all-to-all volume counts replicated KV heads (`kv_traffic_factor`)."""
    tokens = np.asarray(tokens, dtype=float)
    degrees = np.asarray(degrees, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    attention = tokens * tokens
    cost = attention + c * tokens
    rank_attention = rank_head_sums(attention, degrees, starts, world_size, num_heads, num_kv_heads)
    rank_cost = rank_attention + rank_sums(c * tokens, degrees, starts, world_size)
    rank_tokens = rank_sums(tokens, degrees, starts, world_size)
    p_eff = min(p_max, world_size, max_degree_for_heads(num_heads) if num_heads else p_max)  # as the planner caps it
    lower_bound = max(float(cost.sum()) / world_size, float(cost.max()) / p_eff)
    num_blocks = world_size // p_eff
    mean_attention = float(attention.sum()) / world_size
    own_attention, own_cost = busiest_rank_share_floors(tokens, c, p_eff, num_heads, num_kv_heads)
    attention_floor = max(mean_attention, own_attention, partition_bound(attention, num_blocks) / p_eff)
    cost_floor = max(lower_bound, own_cost, partition_bound(cost, num_blocks) / p_eff)
    factor = {int(d): kv_traffic_factor(num_heads, num_kv_heads, int(d)) for d in np.unique(degrees)}
    volume = float((tokens * (degrees - 1) / degrees * np.array([factor[d] for d in degrees.tolist()])).sum())
    fixed = float(tokens.sum()) * (p_eff - 1) / p_eff * kv_traffic_factor(num_heads, num_kv_heads, p_eff)
    values, counts = np.unique(degrees, return_counts=True)
    return PlanMetrics(
        attention_balance=_ratio(rank_attention), cost_balance=_ratio(rank_cost),
        token_balance=_ratio(rank_tokens), efficiency=lower_bound / float(rank_cost.max()),
        lower_bound=lower_bound, max_rank_cost=float(rank_cost.max()),
        max_rank_tokens=float(rank_tokens.max()),
        degree_histogram={int(v): int(n) for v, n in zip(values, counts)}, num_packs=num_packs,
        all_to_all_volume=volume, all_to_all_relative=volume / fixed if fixed > 0 else 0.0,
        attention_balance_bound=attention_floor / mean_attention if mean_attention > 0 else 1.0,
        efficiency_bound=lower_bound / cost_floor,
        rank_cost=rank_cost.tolist(), rank_attention=rank_attention.tolist(), rank_tokens=rank_tokens.tolist(),
    )


def with_step_time(metrics: PlanMetrics, plan: Plan, workload, cost, overlap: bool = True) -> PlanMetrics:
    """`metrics` with the modelled step time of `plan` filled in when `cost` has a step model."""
    if cost.step is None:
        return metrics
    tokens = {s.id: s.tokens for s in workload.sequences}
    step = plan_step_time(plan, tokens, cost.step, cost.num_heads, cost.num_kv_heads, cost.shapes.head_dim, overlap)
    return replace(metrics, **step.summary())  # type: ignore[arg-type]


def plan_metrics(plan: Plan, tokens_by_id: Mapping[str, int], c: float, num_heads: int | None = None,
                 num_kv_heads: int | None = None) -> PlanMetrics:
    """Metrics of a plan file given each sequence's token count (and the model's head counts)."""
    tokens, degrees, starts = [], [], []
    for pack in plan.packs:
        for seq_id in pack.sequences:
            tokens.append(tokens_by_id[seq_id])
            degrees.append(pack.degree)
            starts.append(pack.ranks[0])
    return compute_metrics(np.array(tokens), np.array(degrees), np.array(starts), world_size=plan.world_size,
                           p_max=plan.p_max, c=c, num_packs=len(plan.packs), num_heads=num_heads,
                           num_kv_heads=num_kv_heads)
