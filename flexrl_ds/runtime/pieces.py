"""Per-rank pieces of a FlexUlysses pass back into whole sequences.

A rank returns, per sequence it holds a slice of, `(first position, values at positions first..)`;
`assemble` puts every rank's pieces together and keeps the response part: value i is for the token
at `response_start + i` (predicted at position `response_start - 1 + i`).
"""

from __future__ import annotations

from typing import Any


def assemble(samples: dict[str, Any], per_rank: list[dict[str, list]]) -> dict[str, list[float]]:
    """Response log-probs per sequence from every rank's pieces; checks full coverage."""
    out = {}
    for seq_id, sample in samples.items():
        values: list[float | None] = [None] * sample.length
        for pieces in per_rank:
            for lo, chunk in pieces.get(seq_id, ()):
                values[lo:lo + len(chunk)] = chunk
        wanted = values[sample.response_start - 1:sample.length - 1]
        if any(v is None for v in wanted):
            raise RuntimeError(f"sequence {seq_id!r}: some positions came back from no rank")
        out[seq_id] = wanted
    return out

