"""Dynamic packing: sequences placed on the same group become packs. Pure.

On each group (degree, first rank), sequences shorter than `h_pack` tokens are packed together
(first-fit decreasing) into packs of at most `H_pack` tokens; longer sequences stay alone. One pack
of degree > 1 is one attention call (varlen) and one set of all-to-alls per layer, so packing short
sequences cuts per-call latency without changing any rank's load. (A rank's consecutive degree-1
packs need no exchange and run as one call: sp/layout.py `attention_units`.)

Defaults (when the config leaves them None): `h_pack = 4096` — below it, attention (L²) is under
~6 % of a Qwen2.5-VL-7B sequence's cost (c ≈ 65,000), so a sequence is latency-bound and
worth merging; `H_pack = 4·h_pack` — large enough to merge a handful of short samples, small enough
that a packed call stays a modest fraction of one long sequence's attention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

DEFAULT_H_PACK_SHORT = 4096
"""Default h_pack: sequences below this many tokens are packed."""
PACK_BUDGET_FACTOR = 4
"""Default H_pack = PACK_BUDGET_FACTOR × h_pack."""


@dataclass(frozen=True)
class PackingLimits:
    """Thresholds of dynamic packing."""

    h_pack: int
    """Sequences shorter than this many tokens may share a pack."""
    H_pack: int
    """Token budget of one pack of short sequences."""


def packing_limits(h_pack: int | None, H_pack: int | None) -> PackingLimits:
    """Resolve None to the defaults, keeping h_pack ≤ H_pack."""
    if h_pack is None and H_pack is None:
        return PackingLimits(DEFAULT_H_PACK_SHORT, PACK_BUDGET_FACTOR * DEFAULT_H_PACK_SHORT)
    if H_pack is None:
        assert h_pack is not None
        return PackingLimits(h_pack, PACK_BUDGET_FACTOR * h_pack)
    if h_pack is None:
        return PackingLimits(min(DEFAULT_H_PACK_SHORT, H_pack), H_pack)
    if h_pack > H_pack:
        raise ValueError(f"--h-pack ({h_pack}) exceeds --H-pack ({H_pack})")
    return PackingLimits(h_pack, H_pack)


def pack_group(seq_indices: Sequence[int], tokens: Sequence[int], limits: PackingLimits) -> list[list[int]]:
    """Split the sequences of one group into packs: long ones alone, short ones first-fit decreasing.

    Returned packs are ordered longest first (the order the group runs them in).
    """
    h_pack, size_of = limits.h_pack, tokens.__getitem__
    long = [i for i in seq_indices if tokens[i] >= h_pack]
    short = [i for i in seq_indices if tokens[i] < h_pack]
    long.sort(key=size_of, reverse=True)  # stable: equal sizes keep their order, as key -size would
    if not short:
        return [[i] for i in long]
    short.sort(key=size_of, reverse=True)
    bins: list[list[int]] = []
    room: list[int] = []
    for index in short:
        size = tokens[index]
        for b, free in enumerate(room):
            if size <= free:
                bins[b].append(index)
                room[b] -= size
                break
        else:
            bins.append([index])
            room.append(limits.H_pack - size)
    return [[i] for i in long] + bins
