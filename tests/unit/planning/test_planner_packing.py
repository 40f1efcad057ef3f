"""Dynamic packing of short sequences."""

from __future__ import annotations

import pytest

from flexrl_ds.planning.packing import DEFAULT_H_PACK_SHORT, PackingLimits, pack_group, packing_limits


def test_defaults_and_partial_overrides():
    assert packing_limits(None, None) == PackingLimits(DEFAULT_H_PACK_SHORT, 4 * DEFAULT_H_PACK_SHORT)
    assert packing_limits(100, None) == PackingLimits(100, 400)
    assert packing_limits(None, 1000) == PackingLimits(1000, 1000)
    with pytest.raises(ValueError, match="--h-pack"):
        packing_limits(500, 100)


def test_long_sequences_alone_short_ones_packed_under_budget():
    tokens = [5000, 300, 300, 900, 100, 4096, 800, 50]
    packs = pack_group(list(range(len(tokens))), tokens, PackingLimits(h_pack=1000, H_pack=1200))
    flat = sorted(i for pack in packs for i in pack)
    assert flat == list(range(len(tokens)))
    for pack in packs:
        if any(tokens[i] >= 1000 for i in pack):
            assert len(pack) == 1
        else:
            assert sum(tokens[i] for i in pack) <= 1200
    assert packs[0] == [0] and packs[1] == [5]  # long ones first, longest first
    # Short ones total 2450 tokens > 2 x 1200, so first-fit decreasing needs (and uses) three packs.
    assert packs[2:] == [[3, 1], [6, 2, 4], [7]]
