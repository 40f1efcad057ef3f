"""FlexUlysses attention: Ulysses sequence parallelism with a degree (and group) per pack.

Contract (for the model adapter):

    attn = FlexUlyssesAttention(local_attention=None, overlap=True)
    out = attn(q, k, v, layout, scaling=None)

- `q` (local_tokens, num_heads, head_dim), `k`/`v` (local_tokens, num_kv_heads, head_dim): this rank's
  local tokens in `layout` order (`RankLayout` from flexrl_ds/sp/layout.py), rotary already applied.
- returns `out` (local_tokens, num_heads, head_dim) in the same order, differentiable w.r.t. q, k, v.
- `scaling`: softmax scale; None means 1/sqrt(head_dim).
- Every rank of the SP domain must call it once per attention layer with its own layout of the
  same plan (the collectives of a pack involve all of the pack's ranks).

Per pack, in the plan's Highest-Sharding-First order: sequence-gather / head-scatter all-to-all within
the pack's group, causal varlen attention over the pack's whole sequences for this rank's heads,
all-to-all back. A rank's consecutive degree-1 packs exchange nothing and run as one varlen call
(`RankLayout.attention_units`). With `overlap`, pack j+1's first all-to-all (q, k, v in one collective) is issued
asynchronously before pack j's attention runs and waited for only when pack j+1 starts. The shape of
DeepSpeed's `DistributedAttention` (a wrapper given the local attention; groups passed in, here via the
layout) is kept; see flexrl_ds/sp/all_to_all.py for which exchanges use DeepSpeed's primitives.
"""

from __future__ import annotations

from typing import Callable

import torch

from flexrl_ds.parallel.device import constant_on
from flexrl_ds.sp import all_to_all as a2a
from flexrl_ds.sp.layout import PackShard, RankLayout
from flexrl_ds.sp.local_attention import CausalVarlenAttention


class FlexUlyssesAttention:
    """Variable-degree Ulysses attention over a `RankLayout` (see module docstring for the contract)."""

    def __init__(self, local_attention: Callable | None = None, overlap: bool = True,
                 use_deepspeed: bool = True):
        """local_attention: `(q, k, v, cu_seqlens, max_seqlen, scaling) -> out`, causal per sequence;
        None: `CausalVarlenAttention("auto")`. overlap: prefetch pack j+1's all-to-all during pack j.
        use_deepspeed: use DeepSpeed's `_SeqAllToAll` for packs it admits (synchronous exchanges only,
        so only when `overlap` is False)."""
        self.local_attention = local_attention or CausalVarlenAttention()
        self.overlap = overlap
        self.use_deepspeed = use_deepspeed
        self.last_paths: list[str] = []
        """Exchange used by each of the layout's packs in the last call: local | deepspeed | flex | flex-async."""

    def __call__(self, q, k, v, layout: RankLayout, scaling: float | None = None):
        num_heads, num_kv_heads = _check_inputs(q, k, v, layout)
        units = layout.attention_units  # consecutive degree-1 packs joined: one call
        packs = [pack for pack, _ in units]
        # One split into the packs' contiguous token ranges: its backward is one concatenation, where
        # a slice per pack would make a zero-filled full-size gradient per pack and add them up.
        sizes = [pack.num_local_tokens for pack in packs]
        parts = list(zip(q.split(sizes), k.split(sizes), v.split(sizes)))
        use_ds = self.use_deepspeed and not self.overlap and a2a.deepspeed_exchange_ready()
        self.last_paths = []
        outs = []
        pending = self._issue(parts[0], units[0], num_heads, num_kv_heads, use_ds, async_op=False) if units else None
        for index, pack in enumerate(packs):
            current, pending = pending, None
            if index + 1 < len(packs) and self.overlap:
                pending = self._issue(parts[index + 1], units[index + 1], num_heads, num_kv_heads, use_ds,
                                      async_op=True)
            q_p, k_p, v_p = current.wait()
            heads = _heads_of(pack, num_heads, num_kv_heads)
            out_p = self._attend(q_p, k_p, v_p, pack, heads[pack.rank_in_group], num_heads // num_kv_heads, scaling)
            outs.append(self._back(out_p, pack, heads, use_ds, num_heads, num_kv_heads))
            if index + 1 < len(packs) and not self.overlap:
                pending = self._issue(parts[index + 1], units[index + 1], num_heads, num_kv_heads, use_ds,
                                      async_op=False)
        if not outs:  # a rank without packs: an empty output still connected to q, k, v for autograd
            return q.clone() + (k.sum() + v.sum()) * 0
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    # -------------------------------------------------------------------------------------- steps
    def _issue(self, part, unit: tuple[PackShard, int], num_heads: int, num_kv_heads: int, use_ds: bool,
               async_op: bool):
        """Start the pack's exchange of its local (q, k, v) `part`; `.wait()` gives the pack's."""
        pack, plan_packs = unit
        q_s, k_s, v_s = part
        if pack.degree == 1:
            self.last_paths.extend(["local"] * plan_packs)
            return _Ready((q_s, k_s, v_s))
        if use_ds and a2a.deepspeed_admits(pack.shard_sizes, num_heads, num_kv_heads):
            self.last_paths.append("deepspeed")
            return _Ready(tuple(a2a.deepspeed_seq_to_heads(t, pack.group) for t in (q_s, k_s, v_s)))
        self.last_paths.append("flex-async" if async_op else "flex")
        heads = _heads_of(pack, num_heads, num_kv_heads)
        return a2a.issue_seq_to_heads(q_s, k_s, v_s, pack.group, pack.shard_sizes, heads,
                                      pack.rank_in_group, async_op)

    def _attend(self, q_p, k_p, v_p, pack: PackShard, part: a2a.HeadSlice, group_size: int, scaling):
        kv_of_q = [h // group_size - part.kv_start for h in range(part.q_start, part.q_end)]
        ratio = part.num_q // part.num_kv
        if part.num_q % part.num_kv or kv_of_q != [i // ratio for i in range(part.num_q)]:
            # Non-uniform GQA slice (uneven head split): give every query head its own KV copy.
            index = constant_on(tuple(kv_of_q), torch.long, k_p.device)
            k_p, v_p = k_p.index_select(1, index), v_p.index_select(1, index)
        return self.local_attention(q_p, k_p, v_p, pack.cu_seqlens, pack.max_seqlen, scaling)

    def _back(self, out_p, pack: PackShard, heads, use_ds: bool, num_heads: int, num_kv_heads: int):
        if pack.degree == 1:
            return out_p
        if use_ds and a2a.deepspeed_admits(pack.shard_sizes, num_heads, num_kv_heads):
            return a2a.deepspeed_heads_to_seq(out_p, pack.group)
        return a2a.heads_to_seq(out_p, pack.group, pack.shard_sizes, heads, pack.rank_in_group)


class _Ready:
    """An exchange that already completed (degree 1 or synchronous)."""

    def __init__(self, tensors):
        self._tensors = tensors

    def wait(self):
        return self._tensors


def _heads_of(pack: PackShard, num_heads: int, num_kv_heads: int) -> list[a2a.HeadSlice]:
    if pack.degree == 1:
        return [a2a.HeadSlice(0, num_heads, 0, num_kv_heads)]
    return a2a.head_partition(num_heads, num_kv_heads, pack.degree)


def _check_inputs(q, k, v, layout: RankLayout) -> tuple[int, int]:
    """Shape checks; head checks use the whole plan's max degree so all ranks agree."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"FlexUlyssesAttention: q/k/v must be (tokens, heads, head_dim), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"FlexUlyssesAttention: k {tuple(k.shape)} / v {tuple(v.shape)} do not match "
                         f"q {tuple(q.shape)}")
    if q.shape[0] != layout.num_local_tokens:
        raise ValueError(f"FlexUlyssesAttention: rank {layout.rank} got {q.shape[0]} tokens but its "
                         f"layout holds {layout.num_local_tokens}")
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads % num_kv_heads or num_heads < layout.max_degree:
        raise ValueError(f"FlexUlyssesAttention: {num_heads} query / {num_kv_heads} KV heads cannot be "
                         f"split over degree {layout.max_degree}")
    return num_heads, num_kv_heads
