"""Balance metrics of a plan (plan-schema.md "Metrics"); pure, numpy only.

Per rank, a sequence of `L` tokens in a pack of degree `d` contributes `L²·h_r/H` attention (h_r of
the model's H query heads on that rank, as the executor splits them; `L²/d` without head counts),
`L²·h_r/H + c·L/d` cost and `L/d` tokens to each rank of its group. A balance ratio is max ÷ mean over
ranks; efficiency is the lower bound `max(Σ cost / W, max_s cost(s) / p_max)` ÷ the max rank cost;
all-to-all volume is `Σ L·(d−1)/d`, also given relative to fixed SP at `p_max` (every sequence
sharded at `min(p_max, W)`).

Bounds (what no plan on aligned groups of at most `p = min(p_max, W)` ranks can beat): every
sequence lies inside one aligned p-block, and the busiest rank of a block carries at least the
block's total ÷ p, so the busiest rank is at least `partition_bound(values, W/p) / p` — a lower
bound on the best split of the sequences' values over W/p bins (`partition_bound`, and
`pairing_bound` where bins hold one or two large values each; `split_bound` is the larger). With it:
`attention_balance_bound = max(mean, max_s L²/p, split_bound(L², W/p)/p) ÷ mean` and
`efficiency_bound = lower_bound ÷ max(lower_bound, split_bound(cost, W/p)/p)` (the best
efficiency reachable; below 1 where the schema's lower bound is not attainable).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Mapping

import numpy as np

from flexrl_ds.planning.heads import heads_per_rank, kv_heads_held
from flexrl_ds.planning.plan import Plan


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


PAIRING_TERMS = 64
"""`pairing_bound` tries at most this many counts j (its cost is O(j²); the bound stays valid)."""


def pairing_bound(values: np.ndarray, num_bins: int) -> float:
    """Lower bound on the largest bin sum of any split of `values` over `num_bins` bins (B),
    sharper than `partition_bound` where bins hold 1–2 large values each. For each j with
    1 ≤ j ≤ B and B + j ≤ n, take the m = B + j largest values: either some bin holds three of them
    (its sum ≥ the 3 smallest of the m), or every bin holds at most two, and then at least j bins
    hold two (2a + b = m, a + b ≤ B ⇒ a ≥ j): j disjoint pairs of the m, whose largest pair sum is
    at least that of the 2j smallest of the m paired largest-with-smallest (that pairing minimises
    the largest sum of a fixed set, and smaller values only lower it). The bound for j is the
    smaller of the two cases; the result is the largest over j (at most PAIRING_TERMS of them)."""
    ranked = np.sort(np.asarray(values, dtype=float))[::-1]
    num_terms = min(num_bins, len(ranked) - num_bins, PAIRING_TERMS)
    if num_terms < 1:
        return float(ranked[0]) if len(ranked) else 0.0
    j = np.arange(1, num_terms + 1)[:, None]
    t = np.arange(num_terms)[None, :]
    pair_sums = ranked[np.minimum(num_bins - j + t, len(ranked) - 1)] + ranked[np.maximum(num_bins + j - 1 - t, 0)]
    folded = np.where(t < j, pair_sums, -np.inf).max(axis=1)
    m = num_bins + j[:, 0]
    padded = np.concatenate([[0.0, 0.0], ranked])
    three = padded[m + 1] + padded[m] + padded[m - 1]  # ranked[m-1] + ranked[m-2] + ranked[m-3]
    return float(max(ranked[0], np.minimum(folded, three).max()))


def split_bound(values: np.ndarray, num_bins: int) -> float:
    """The larger of `partition_bound` and `pairing_bound` (both valid lower bounds)."""
    return max(partition_bound(values, num_bins), pairing_bound(values, num_bins))


def attention_cost_infeasible(cost: np.ndarray, attention: np.ndarray, num_bins: int, attention_cap: float,
                              cost_cap: float) -> bool:
    """True when no split of the items over `num_bins` bins keeps every bin's attention ≤
    `attention_cap` and cost ≤ `cost_cap` at once (absolute bin sums; a certificate: False says
    nothing). Each bound alone may be reachable; together they are not where the long items leave
    too little attention room for the cost their bins must still take. For the m largest items by
    attention (every m), a bin holds at most q of them (q + 1 of the smallest exceed the cap), so
    at least t = m − (q − 1)·bins bins hold exactly q. Those t bins carry at least the t·q smallest
    of the m in attention and at most the t·q largest costs, and — the other bins holding ≤
    cost_cap each — still need cost ≥ Σ cost − (bins − t)·cost_cap − that from the other n − m
    items, within attention room t·cap − that. The least attention buying that cost (fractional,
    lowest attention per cost first, over all items: a valid relaxation) above the room, or the
    other items' total cost below the need, proves it impossible. O(n log n)."""
    by_attention = np.argsort(-np.asarray(attention, dtype=float), kind="stable")
    attention = np.asarray(attention, dtype=float)[by_attention]
    cost = np.asarray(cost, dtype=float)[by_attention]
    n = len(attention)
    if n == 0:
        return False
    if attention[0] > attention_cap or cost.max() > cost_cap:
        return True
    prefix_a, prefix_c = (np.concatenate([[0.0], np.cumsum(row)]) for row in (attention, cost))
    m = np.arange(1, n)
    # q(m): the most of the m largest a bin can hold (sum of the q smallest of them ≤ cap); binary search.
    low, high = np.ones(len(m), dtype=np.int64), m.copy()
    while (low < high).any():
        mid = (low + high + 1) // 2
        fits = prefix_a[m] - prefix_a[m - mid] <= attention_cap
        low, high = np.where(fits, mid, low), np.where(fits, high, mid - 1)
    q = low
    full = m - (q - 1) * num_bins  # bins that must hold exactly q of the m largest
    if (full > num_bins).any():
        return True  # the m largest do not fit at q per bin
    t, m, q = full[full >= 1], m[full >= 1], q[full >= 1]
    held = t * q
    room = t * attention_cap - (prefix_a[m] - prefix_a[m - held])
    most_cost = np.concatenate([[0.0], np.cumsum(np.sort(cost)[::-1])])  # the held largest costs, any items
    need = prefix_c[n] - (num_bins - t) * cost_cap - most_cost[held]
    if (need > prefix_c[n] - prefix_c[m] + 1e-9 * prefix_c[n]).any():
        return True  # the other items do not carry the cost those bins need
    ratio_order = np.argsort(attention / np.maximum(cost, 1e-300), kind="stable")
    cheap_c = np.concatenate([[0.0], np.cumsum(cost[ratio_order])])
    cheap_a = np.concatenate([[0.0], np.cumsum(attention[ratio_order])])
    k = np.clip(np.searchsorted(cheap_c, need), 1, n)
    item = ratio_order[k - 1]
    least = cheap_a[k - 1] + np.maximum(need - cheap_c[k - 1], 0.0) * attention[item] / np.maximum(cost[item], 1e-300)
    least = np.where(need > 0, least, 0.0)
    return bool((least > room + 1e-9 * prefix_a[n]).any())


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
    p_eff = min(p_max, world_size)
    lower_bound = max(float(cost.sum()) / world_size, float(cost.max()) / p_eff)
    num_blocks = world_size // p_eff
    mean_attention = float(attention.sum()) / world_size
    attention_floor = max(mean_attention, float(attention.max()) / p_eff,
                          split_bound(attention, num_blocks) / p_eff)
    cost_floor = max(lower_bound, split_bound(cost, num_blocks) / p_eff)
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
