"""Fixed-degree DeepSpeed-Ulysses baseline: DeepSpeed's own `DistributedAttention` on one group.

The domain is cut into groups of `degree` ranks; each group's sequences form ONE pack sharded over the
whole group (plain Ulysses: every token pays the all-to-all). `fixed_sp_plan` writes that as a plan
(so the same layout, harness and benchmarks serve both systems) and `FixedUlyssesAttention` runs it
through `deepspeed.sequence.layer.DistributedAttention`, built once per group as DeepSpeed intends.
DeepSpeed needs equal shards, so `fixed_sp_plan` adds a padding sequence to each pack whose length is
not a multiple of the degree (padding attends only to itself and is dropped by the caller).
When DeepSpeed is not importable, the same plan runs on FlexUlyssesAttention's exchange instead
(`backend` says which ran).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

from flexrl_ds.sp.all_to_all import deepspeed_exchange_ready
from flexrl_ds.sp.attention import FlexUlyssesAttention, _check_inputs
from flexrl_ds.sp.layout import RankLayout
from flexrl_ds.sp.local_attention import CausalVarlenAttention
from flexrl_ds.planning.plan import Pack, Plan

PAD_PREFIX = "__pad"


def lpt_assign(costs: Mapping[str, float], num_bins: int) -> list[list[str]]:
    """Longest-processing-time-first: each sequence (largest cost first) to the least loaded bin."""
    bins: list[list[str]] = [[] for _ in range(num_bins)]
    loads = [0.0] * num_bins
    for seq_id in sorted(costs, key=lambda s: (-costs[s], s)):
        target = min(range(num_bins), key=lambda b: (loads[b], b))
        bins[target].append(seq_id)
        loads[target] += costs[seq_id]
    return bins


def fixed_sp_plan(seq_lengths: Mapping[str, int], world_size: int, degree: int,
                  costs: Mapping[str, float] | None = None) -> tuple[Plan, dict[str, int]]:
    """Plan of fixed Ulysses degree `degree`: world/degree groups, sequences spread by LPT on `costs`.

    Returns (plan, lengths including padding sequences named `__pad<group>`).
    """
    if world_size % degree != 0:
        raise ValueError(f"fixed SP: degree {degree} does not divide world size {world_size}")
    num_groups = world_size // degree
    bins = lpt_assign(costs if costs is not None else dict(seq_lengths), num_groups)
    lengths = dict(seq_lengths)
    packs = []
    for group, seq_ids in enumerate(bins):
        if not seq_ids:
            raise ValueError(f"fixed SP: group {group} gets no sequence ({len(seq_lengths)} sequences "
                             f"for {num_groups} groups)")
        total = sum(lengths[s] for s in seq_ids)
        if total % degree:
            pad_id = f"{PAD_PREFIX}{group}"
            lengths[pad_id] = degree - total % degree
            seq_ids = seq_ids + [pad_id]
        ranks = tuple(range(group * degree, (group + 1) * degree))
        packs.append(Pack(id=group, degree=degree, ranks=ranks, sequences=tuple(seq_ids)))
    rank_order: dict[int, tuple[int, ...]] = {r: (r // degree,) for r in range(world_size)}
    plan = Plan(world_size=world_size, p_max=degree, packs=tuple(packs), rank_order=rank_order)
    return plan, lengths


class FixedUlyssesAttention:
    """DeepSpeed `DistributedAttention` over a fixed-degree layout (one pack per rank, equal shards)."""

    def __init__(self, local_attention: Callable | None = None):
        self.local_attention = local_attention or CausalVarlenAttention()
        self._by_group: dict[int, object] = {}
        self.backend = "deepspeed" if deepspeed_exchange_ready() else "flex"
        self._fallback = FlexUlyssesAttention(self.local_attention, overlap=False, use_deepspeed=False)

    def __call__(self, q, k, v, layout: RankLayout, scaling: float | None = None):
        _check_inputs(q, k, v, layout)
        if len(layout.packs) != 1 or len(set(layout.packs[0].shard_sizes)) != 1:
            raise ValueError("fixed SP: needs exactly one pack per rank with equal shards (use fixed_sp_plan)")
        pack = layout.packs[0]
        if self.backend != "deepspeed" or pack.degree == 1 or q.shape[1] % pack.degree or k.shape[1] % pack.degree:
            # DeepSpeed's uneven-heads path reads its global SP group, not this one: use our exchange.
            return self._fallback(q, k, v, layout, scaling)
        attention = self._attention_for(pack.group)
        out = attention(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), 1, None,
                        cu_seqlens=pack.cu_seqlens, max_seqlen=pack.max_seqlen, scaling=scaling)
        return out.squeeze(1)

    def _attention_for(self, group):
        from deepspeed.sequence.layer import DistributedAttention

        key = id(group)
        if key not in self._by_group:
            self._by_group[key] = DistributedAttention(_SeqFirstLocal(self.local_attention), group,
                                                       scatter_idx=2, gather_idx=0)
        return self._by_group[key]


class _SeqFirstLocal:
    """Adapts our local attention to DeepSpeed's seq-first (T, batch=1, heads, D) tensors."""

    def __init__(self, local_attention: Callable):
        self.local_attention = local_attention

    def __call__(self, q, k, v, cu_seqlens: Sequence[int], max_seqlen: int, scaling: float | None):
        out = self.local_attention(q.squeeze(1), k.squeeze(1), v.squeeze(1), cu_seqlens, max_seqlen, scaling)
        return out.unsqueeze(1)
