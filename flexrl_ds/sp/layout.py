"""Where every token of a FlexUlysses step lives: one rank's packs, shards and local token order.

Contract between the plan (flexrl_ds/planning/plan.py), the attention (flexrl_ds/sp/attention.py) and the
model adapter:

- A pack of `degree` d holds sequences s_1..s_n concatenated in plan order (`cu_seqlens` are the pack's
  sequence boundaries). Its T tokens are split into d contiguous shards, as even as possible: rank i
  of the block (i = 0..d-1) holds `[shard_bounds[i], shard_bounds[i+1])`, the first `T % d` ranks one
  token more. A shard may cross sequence boundaries; the attention all-to-all restores whole sequences.
- A rank's **local tokens** are its shards of all its packs concatenated in Highest-Sharding-First
  order (`plan.rank_order`). The model runs ONE forward over these tokens; `slice_tokens` cuts any
  per-sequence tensor (input_ids (L,), labels (L,), mRoPE position ids (3, L), embeddings (L, h))
  into that order.
- `build_rank_layout` validates the WHOLE plan (not only this rank's part) before any collective, so
  every rank of the domain reaches the same verdict from the same plan and all fail together.

Plan ranks are SP-domain-local ranks (docs/PLAN_SCHEMA.md); `GroupTree.local_rank` gives this process's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from flexrl_ds.planning.plan import Plan, validate_plan


@dataclass(frozen=True)
class PackShard:
    """One pack as seen from one of its ranks."""

    pack_id: int
    """The plan's pack id."""
    degree: int
    """Ulysses degree of the pack (size of its group)."""
    ranks: tuple[int, ...]
    """Domain-local ranks of the pack's aligned block."""
    group: Any
    """torch.distributed ProcessGroup of the block; None for degree 1 or a layout built without a tree."""
    rank_in_group: int
    """This rank's index inside `ranks`."""
    sequence_ids: tuple[str, ...]
    """The pack's sequences, in pack (concatenation) order."""
    sequence_lengths: tuple[int, ...]
    """Full lengths of the pack's sequences, in pack order."""
    cu_seqlens: tuple[int, ...]
    """Sequence boundaries inside the pack's concatenated tokens: (0, L1, L1+L2, ..., T)."""
    shard_bounds: tuple[int, ...]
    """Token boundaries of the d shards inside the pack: rank i holds [bounds[i], bounds[i+1])."""
    local_offset: int
    """Where this rank's shard starts in the rank's local tokens."""

    @property
    def num_tokens(self) -> int:
        """Tokens of the whole pack (all shards)."""
        return self.cu_seqlens[-1]

    @property
    def start(self) -> int:
        """First pack token of this rank's shard."""
        return self.shard_bounds[self.rank_in_group]

    @property
    def end(self) -> int:
        """One past the last pack token of this rank's shard."""
        return self.shard_bounds[self.rank_in_group + 1]

    @property
    def num_local_tokens(self) -> int:
        return self.end - self.start

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """Tokens held by each rank of the block."""
        return tuple(b - a for a, b in zip(self.shard_bounds, self.shard_bounds[1:]))

    @property
    def max_seqlen(self) -> int:
        return max(self.sequence_lengths)

    def segments(self) -> list[tuple[str, int, int, int]]:
        """(sequence id, first position, end position, local index) pieces of this rank's shard."""
        out = []
        for seq_id, seq_start, seq_end in zip(self.sequence_ids, self.cu_seqlens, self.cu_seqlens[1:]):
            lo, hi = max(seq_start, self.start), min(seq_end, self.end)
            if lo < hi:
                out.append((seq_id, lo - seq_start, hi - seq_start, self.local_offset + lo - self.start))
        return out


@dataclass(frozen=True)
class RankLayout:
    """This rank's packs in HSF order and the resulting local token order."""

    rank: int
    """Domain-local rank."""
    world_size: int
    """Ranks of the SP domain (plan.world_size)."""
    packs: tuple[PackShard, ...]
    """This rank's packs in execution (HSF) order."""
    max_degree: int
    """Largest degree in the whole plan (all ranks): what head splitting is checked against."""

    @property
    def num_local_tokens(self) -> int:
        return sum(p.num_local_tokens for p in self.packs)

    @functools.cached_property
    def attention_units(self) -> tuple[tuple[PackShard, int], ...]:
        """What the attention runs, in order: (pack, how many of `packs` it stands for). A run of
        consecutive degree-1 packs (HSF order puts them last) becomes one pack: they exchange
        nothing, so one varlen call over all their sequences does their attention at once."""
        units: list[tuple[PackShard, int]] = []
        for pack in self.packs:
            if units and pack.degree == 1 and units[-1][0].degree == 1:
                units[-1] = (_joined(units[-1][0], pack), units[-1][1] + 1)
            else:
                units.append((pack, 1))
        return tuple(units)

    def segments(self) -> list[tuple[str, int, int, int]]:
        """(sequence id, first position, end position, local index) of every local piece, in order."""
        return [segment for pack in self.packs for segment in pack.segments()]

    def slice_tokens(self, per_sequence: Mapping[str, Any], dim: int = -1):
        """Concatenate this rank's pieces of per-sequence tensors along the token axis `dim`.

        `per_sequence[id]` holds the WHOLE sequence (e.g. input_ids (L,), position ids (3, L)); the
        result holds exactly this rank's local tokens, in local order.
        """
        import torch

        pieces = []
        for seq_id, lo, hi, _ in self.segments():
            if seq_id not in per_sequence:
                raise ValueError(f"slice_tokens: no tensor given for sequence {seq_id!r}")
            tensor = per_sequence[seq_id]
            pieces.append(tensor.narrow(dim, lo, hi - lo))
        if not pieces:
            reference = next(iter(per_sequence.values()))
            shape = list(reference.shape)
            shape[dim] = 0
            return reference.new_empty(shape)
        return torch.cat(pieces, dim=dim)


def _joined(first: PackShard, second: PackShard) -> PackShard:
    """Two adjacent degree-1 packs of one rank as one: sequences and bounds concatenated."""
    if first.local_offset + first.num_local_tokens != second.local_offset:
        raise ValueError(f"packs {first.pack_id} and {second.pack_id} are not adjacent in the local tokens")
    total = first.num_tokens + second.num_tokens
    return replace(first, sequence_ids=first.sequence_ids + second.sequence_ids,
                   sequence_lengths=first.sequence_lengths + second.sequence_lengths,
                   cu_seqlens=first.cu_seqlens + tuple(first.num_tokens + b for b in second.cu_seqlens[1:]),
                   shard_bounds=(0, total))


def shard_bounds(num_tokens: int, degree: int) -> tuple[int, ...]:
    """Split `num_tokens` into `degree` contiguous shards, the first `num_tokens % degree` one longer."""
    base, extra = divmod(num_tokens, degree)
    bounds = [0]
    for index in range(degree):
        bounds.append(bounds[-1] + base + (1 if index < extra else 0))
    return tuple(bounds)


def validate_layout_inputs(
    plan: Plan,
    seq_lengths: Mapping[str, int],
    group_tree: Any = None,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    max_tokens_per_rank: int | None = None,
) -> None:
    """Check everything the attention will rely on, for the whole plan; ValueError names the culprit.

    Runs without collectives and depends only on its arguments, so every rank decides the same.
    """
    for seq_id, length in seq_lengths.items():
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"sequence {seq_id!r}: length must be a positive integer, got {length!r}")
    validate_plan(plan, list(seq_lengths))
    if group_tree is not None:
        topology = group_tree.topology
        if plan.world_size != topology.domain_size:
            raise ValueError(f"plan has world_size {plan.world_size} but the SP domain has "
                             f"{topology.domain_size} ranks (world {topology.world_size})")
        for pack in plan.packs:
            if not group_tree.has_group(pack.degree, pack.ranks[0]):
                raise ValueError(f"plan: pack {pack.id} needs a group of degree {pack.degree} on ranks "
                                 f"{list(pack.ranks)}, which the group tree does not have "
                                 f"(p_max={topology.p_max})")
    max_degree = max((p.degree for p in plan.packs), default=1)
    _validate_heads(num_heads, num_kv_heads, max_degree)
    if max_tokens_per_rank is not None:
        _validate_token_cap(plan, seq_lengths, max_tokens_per_rank)


def _validate_heads(num_heads: int | None, num_kv_heads: int | None, max_degree: int) -> None:
    if num_heads is None:
        return
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"heads: {num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if num_heads < max_degree:
        raise ValueError(f"heads: {num_heads} query heads cannot be split over degree {max_degree} "
                         f"(each rank of a pack needs at least one head)")


def _validate_token_cap(plan: Plan, seq_lengths: Mapping[str, int], cap: int) -> None:
    held = [0] * plan.world_size
    for pack in plan.packs:
        total = sum(seq_lengths[s] for s in pack.sequences)
        for rank, size in zip(pack.ranks, _sizes(shard_bounds(total, pack.degree))):
            held[rank] += size
    worst = max(range(plan.world_size), key=lambda r: held[r])
    if held[worst] > cap:
        longest = max(seq_lengths, key=lambda s: seq_lengths[s])
        raise ValueError(f"token cap: rank {worst} would hold {held[worst]} tokens > max_tokens_per_rank "
                         f"{cap} (longest sequence {longest!r}: {seq_lengths[longest]} tokens)")


def _sizes(bounds: Sequence[int]) -> list[int]:
    return [b - a for a, b in zip(bounds, bounds[1:])]


def build_rank_layout(
    plan: Plan,
    seq_lengths: Mapping[str, int],
    rank: int,
    group_tree: Any = None,
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    max_tokens_per_rank: int | None = None,
) -> RankLayout:
    """This rank's `RankLayout`, after validating the whole plan (see `validate_layout_inputs`).

    rank: the domain-local rank (`group_tree.local_rank`). group_tree: a `GroupTree`; None builds a
    layout without process groups (planning, tests, reference computations).
    num_heads / num_kv_heads: the model's attention heads, checked against the plan's degrees.
    """
    validate_layout_inputs(plan, seq_lengths, group_tree, num_heads, num_kv_heads, max_tokens_per_rank)
    if not 0 <= rank < plan.world_size:
        raise ValueError(f"rank {rank} is outside the plan's world_size {plan.world_size}")
    if group_tree is not None and group_tree.local_rank != rank:
        raise ValueError(f"rank {rank} is not this process's domain-local rank {group_tree.local_rank}")
    shards, offset = [], 0
    for pack in plan.packs_of_rank(rank):
        lengths = tuple(seq_lengths[s] for s in pack.sequences)
        cu = [0]
        for length in lengths:
            cu.append(cu[-1] + length)
        group = group_tree.group_for(pack.degree, pack.ranks[0]) if group_tree is not None else None
        shard = PackShard(pack_id=pack.id, degree=pack.degree, ranks=pack.ranks, group=group,
                          rank_in_group=pack.ranks.index(rank), sequence_ids=pack.sequences,
                          sequence_lengths=lengths, cu_seqlens=tuple(cu),
                          shard_bounds=shard_bounds(cu[-1], pack.degree), local_offset=offset)
        shards.append(shard)
        offset += shard.num_local_tokens
    max_degree = max((p.degree for p in plan.packs), default=1)
    return RankLayout(rank=rank, world_size=plan.world_size, packs=tuple(shards), max_degree=max_degree)
