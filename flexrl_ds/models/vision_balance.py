"""Vision-tower balancing: the SP domain's images/frames spread evenly over its ranks by patch count.

The vision tower's cost follows patches, not text, and has nothing to do with which rank holds which
LLM tokens. So (1) every image and every temporal patch group of a video becomes a *unit*
(Qwen2.5-VL's vision tower attends within one temporal group only, Qwen3-VL's within one frame group:
a video with grid (t, h, w) encodes exactly like t grids (1, h, w)); (2) `assign_units` spreads units
over the domain's ranks by patch count (largest first onto the least loaded rank, deterministic); (3)
each rank encodes only its units; (4) merged embeddings travel with ONE autograd all-to-all over the
domain to the ranks that hold those token positions in the FlexUlysses layout (the backward is the reverse all-to-all).

Planning (`vision_units`, `assign_units`, `build_route`) is pure and identical on every rank (it only
reads the step's shared metadata); `encode_and_route` executes. Under ZeRO-3 every rank must run the
vision tower every step: a rank without units encodes a minimal dummy grid whose output enters the
graph multiplied by zero.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from flexrl_ds.parallel.device import to_device


@dataclass(frozen=True)
class VisionUnit:
    """One image, or one temporal patch group of a video: the granule of vision balancing."""

    seq_id: str
    item_index: int
    """Index of the media item inside its sequence (prompt order, images and videos mixed)."""
    t_index: int
    """Temporal group inside the item (0 for an image)."""
    grid_hw: tuple[int, int]
    """Patch rows and columns of one temporal group."""
    token_start: int
    """Position (in the whole sequence) of the unit's first merged token."""
    num_tokens: int
    """Merged LLM tokens of the unit (h*w / merge**2)."""
    share_key: str | None = None
    """Units with the same key have identical pixels (e.g. the GRPO samples of one prompt): the step
    encodes them once and routes the rows to every sequence that has them. None: not shared."""

    @property
    def num_patches(self) -> int:
        return self.grid_hw[0] * self.grid_hw[1]


def vision_units(seq_order: Sequence[str], input_ids: Mapping[str, torch.Tensor],
                 items: Mapping[str, Sequence], vision_token_ids: Sequence[int], merge_size: int = 2
                 ) -> list[VisionUnit]:
    """All units of a step, in a global order every rank agrees on (sequence, item, temporal group).

    `items[seq]` are the sequence's VisionItems (kind, grid_thw) in prompt order; their merged tokens
    are the sequence's vision-pad tokens, in order.
    """
    units = []
    for seq_id in seq_order:
        ids = input_ids[seq_id]
        positions = torch.isin(ids, torch.tensor(list(vision_token_ids))).nonzero().flatten().tolist()
        cursor = 0
        for item_index, item in enumerate(items.get(seq_id, ())):
            t, h, w = item.grid_thw
            per_group = h * w // (merge_size * merge_size)
            for t_index in range(t):
                start = positions[cursor] if cursor < len(positions) else -1
                if cursor + per_group > len(positions) or positions[cursor + per_group - 1] != start + per_group - 1:
                    raise ValueError(f"sequence {seq_id!r}: vision pad tokens do not match item {item_index} "
                                     f"grid {tuple(item.grid_thw)}")
                key = getattr(item, "share_key", None)
                units.append(VisionUnit(seq_id, item_index, t_index, (h, w), start, per_group,
                                        f"{key}#{t_index}" if key else None))
                cursor += per_group
        if cursor != len(positions):
            raise ValueError(f"sequence {seq_id!r}: {len(positions)} vision pad tokens but its items "
                             f"account for {cursor}")
    return units


def representatives(units: Sequence[VisionUnit]) -> list[int]:
    """Index of the unit that is actually encoded for each unit (the first one with its share key)."""
    first: dict[str, int] = {}
    return [i if unit.share_key is None else first.setdefault(unit.share_key, i) for i, unit in enumerate(units)]


def assign_units(num_patches: Sequence[int], num_ranks: int) -> list[int]:
    """Rank of every unit: largest first onto the least loaded rank (ties: lower rank, earlier unit)."""
    if num_ranks < 1:
        raise ValueError(f"vision balancing: num_ranks must be >= 1, got {num_ranks}")
    loads = [0] * num_ranks
    owner = [0] * len(num_patches)
    for index in sorted(range(len(num_patches)), key=lambda i: (-num_patches[i], i)):
        rank = min(range(num_ranks), key=lambda r: (loads[r], r))
        owner[index] = rank
        loads[rank] += num_patches[index]
    return owner


@dataclass(frozen=True)
class VisionRoute:
    """One rank's part of the step's vision work and of the embedding all-to-all."""

    my_units: tuple[VisionUnit, ...]
    """Units this rank encodes, in global order (its merged rows come out in this order)."""
    send_index: torch.Tensor
    """Rows of this rank's merged output, grouped by destination rank (int64)."""
    send_splits: tuple[int, ...]
    """Rows sent to each rank of the domain."""
    recv_splits: tuple[int, ...]
    """Rows received from each rank of the domain."""
    recv_local_index: torch.Tensor
    """Local token index (this rank's layout) of every received row, in receive order (int64)."""
    patches_per_rank: tuple[int, ...]
    """Patches each rank encodes (balance report)."""


def token_owners(layouts: Sequence) -> dict[str, list[tuple[int, int, int, int]]]:
    """seq id -> [(first pos, end pos, rank, local index of first pos)] from every rank's layout."""
    owners: dict[str, list[tuple[int, int, int, int]]] = {}
    for rank, layout in enumerate(layouts):
        for seq_id, lo, hi, local in layout.segments():
            owners.setdefault(seq_id, []).append((lo, hi, rank, local))
    return owners


def _ranges_to_index(ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Concatenated aranges of (start, length) ranges as int64."""
    if not ranges:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(start, start + length, dtype=torch.long) for start, length in ranges])


def build_route(units: Sequence[VisionUnit], unit_rank: Sequence[int], layouts: Sequence, rank: int) -> VisionRoute:
    """This rank's route, from the step's units, their encoder ranks and EVERY rank's layout.

    Works on token ranges (a unit's tokens are contiguous in its sequence, and so is each rank's
    piece of it), so the cost is units x pieces, not vision tokens. Rows travel in the same order on
    both sides: units in global order, then the unit's pieces in `token_owners` order. A unit that
    shares its key with an earlier one is not encoded again: it receives that unit's rows (its
    `unit_rank` entry is ignored; the representative's encoder sends).
    """
    num_ranks = len(layouts)
    owners = token_owners(layouts)
    rep = representatives(units)
    send: list[list[tuple[int, int]]] = [[] for _ in range(num_ranks)]
    recv: list[list[tuple[int, int]]] = [[] for _ in range(num_ranks)]
    patches = [0] * num_ranks
    row_of: dict[int, int] = {}  # encoded unit index -> its first row in this rank's merged output
    row = 0
    for index, unit in enumerate(units):
        if rep[index] == index:
            patches[unit_rank[index]] += unit.num_patches
            if unit_rank[index] == rank:
                row_of[index], row = row, row + unit.num_tokens
    for index, unit in enumerate(units):
        encoder = unit_rank[rep[index]]
        first, end = unit.token_start, unit.token_start + unit.num_tokens
        covered = 0
        for lo, hi, owner, local in owners[unit.seq_id]:
            a, b = max(lo, first), min(hi, end)
            if a >= b:
                continue
            covered += b - a
            if encoder == rank:
                send[owner].append((row_of[rep[index]] + a - first, b - a))
            if owner == rank:
                recv[encoder].append((local + a - lo, b - a))
        assert covered == unit.num_tokens, (unit, covered)
    return VisionRoute(
        my_units=tuple(units[i] for i in row_of),
        send_index=_ranges_to_index([r for dest in send for r in dest]),
        send_splits=tuple(sum(n for _, n in dest) for dest in send),
        recv_splits=tuple(sum(n for _, n in src) for src in recv),
        recv_local_index=_ranges_to_index([r for src in recv for r in src]),
        patches_per_rank=tuple(patches),
    )


def unit_pixels(unit: VisionUnit, item) -> torch.Tensor:
    """The pixel rows of one unit inside its item's `pixel_values` (temporal groups are contiguous)."""
    rows = unit.num_patches
    return item.pixel_values[unit.t_index * rows:(unit.t_index + 1) * rows]


def encode_and_route(visual, route: VisionRoute, items: Mapping[str, Sequence], group,
                     merge_size: int = 2, encode=None, call_inputs=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode this rank's units and exchange merged rows; returns (received rows, zero term).

    encode: `(visual, pixels, grids, inputs) -> (merged rows, extra rows or None)`, the family's tower
    call (`ModelFamily.encode_vision`; None: `visual(...).pooler_output`). Extra rows (DeepStack
    features, (tokens, k*hidden)) travel in the same exchange, concatenated after the merged rows'
    hidden axis: the received rows are then (rows, (1+k)*hidden).
    call_inputs: `(visual, grids on the host) -> keywords of the tower call`
    (`ModelFamily.vision_call_inputs`), computed before the grids move and sent with the pixels from
    pinned memory (`parallel.device.to_device`); None: the tower computes them from its device grids.

    group: the SP domain's process group (`GroupTree.domain_group`), whose ranks in group order are
    the domain-local ranks the route's split lists index; None means the default (world) group and
    is accepted only when the domain is the whole world (checked: `exchange_group_size`).
    received rows: (sum(recv_splits), hidden) in `route.recv_local_index` order. zero term: a scalar
    that is 0 but depends on the vision tower's output (add it to the loss so that a rank without
    units still gives the tower's parameters a gradient, as ZeRO-3 needs).
    """
    param = next(visual.parameters())
    if route.my_units:
        pixels = torch.cat([unit_pixels(u, items[u.seq_id][u.item_index]) for u in route.my_units])
        grids = torch.tensor([[1, *u.grid_hw] for u in route.my_units], dtype=torch.long)
    else:  # ZeRO-3: run the tower anyway on the smallest valid grid
        side = merge_size
        patch_dim = visual.config.in_channels * visual.config.temporal_patch_size * visual.config.patch_size ** 2
        pixels = torch.zeros(side * side, patch_dim)
        grids = torch.tensor([[1, side, side]], dtype=torch.long)
    inputs = call_inputs(visual, grids) if call_inputs is not None else {}
    inputs = {key: to_device(value, param.device) if isinstance(value, torch.Tensor) else value
              for key, value in inputs.items()}
    pixels, grids = to_device(pixels.to(param.dtype), param.device), to_device(grids, param.device)
    if encode is None:
        merged = visual(pixels, grid_thw=grids, **inputs).pooler_output
    else:
        merged, extra = encode(visual, pixels, grids, inputs)
        merged = merged if extra is None else torch.cat([merged, extra.to(merged.dtype)], dim=-1)
    zero_term = merged.sum() * 0.0
    send = merged.index_select(0, to_device(route.send_index, merged.device)) if route.my_units else merged[:0]
    if exchange_group_size(route, group) == 1:
        return send, zero_term
    recv = _RowExchange.apply(send, group, route.send_splits, route.recv_splits)
    return recv, zero_term


def exchange_group_size(route: VisionRoute, group) -> int:
    """Ranks of the embedding exchange: the route's domain size, after checking that `group` has it
    (a world group under a route of one domain of several would mismatch the split lists)."""
    import torch.distributed as dist

    num_ranks = len(route.send_splits)
    if num_ranks == 1:
        return 1
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    if size != num_ranks:
        raise ValueError(f"vision exchange: the route spans an SP domain of {num_ranks} ranks but its process "
                         f"group has {size}: pass the domain's group (GroupTree.domain_group)"
                         + (", not the default world group" if group is None else ""))
    return num_ranks


class _RowExchange(torch.autograd.Function):
    """all_to_all_single of (rows, hidden) with per-rank row counts; backward runs the reverse exchange."""

    @staticmethod
    def forward(ctx, send, group, send_splits, recv_splits):
        import torch.distributed as dist

        ctx.group, ctx.send_splits, ctx.recv_splits = group, send_splits, recv_splits
        recv = send.new_empty((sum(recv_splits), send.shape[1]))
        dist.all_to_all_single(recv, send.contiguous(), list(recv_splits), list(send_splits), group=group)
        return recv

    @staticmethod
    def backward(ctx, grad_recv):
        import torch.distributed as dist

        grad_send = grad_recv.new_empty((sum(ctx.send_splits), grad_recv.shape[1]))
        dist.all_to_all_single(grad_send, grad_recv.contiguous(), list(ctx.send_splits), list(ctx.recv_splits),
                               group=ctx.group)
        return grad_send, None, None, None
