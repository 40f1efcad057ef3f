"""Which attention heads each rank of a Ulysses group holds (pure: the executor and the planner share it).

Ulysses scatters query heads over the `degree` ranks of a pack; each rank also needs the KV heads
its query heads use (GQA), replicated when there are fewer KV heads than ranks. The executor's
all-to-all (`flexrl_ds.sp.all_to_all`) uses `head_partition` as is, so the planner's cost of a rank
(`heads_per_rank`) and the traffic of a pack (`kv_heads_sent`) are what the executor does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HeadSlice:
    """Heads one rank of a pack owns during attention."""

    q_start: int
    """First query head of the rank."""
    q_end: int
    """One past its last query head."""
    kv_start: int
    """First KV head it needs."""
    kv_end: int
    """One past the last KV head it needs."""

    @property
    def num_q(self) -> int:
        return self.q_end - self.q_start

    @property
    def num_kv(self) -> int:
        return self.kv_end - self.kv_start


def head_partition(num_heads: int, num_kv_heads: int, degree: int) -> list[HeadSlice]:
    """Split query heads over `degree` ranks, each rank getting the KV heads its query heads use.

    - KV heads divisible by the degree: contiguous, even chunks (DeepSpeed's layout).
    - Degree a multiple of the KV heads: each KV head's query group is split over degree/K ranks,
      so every rank needs exactly one KV head (replicated over those ranks).
    - Otherwise: query heads split as evenly as possible; KV heads replicated as needed.
    """
    if num_heads < degree or num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"heads: cannot split {num_heads} query / {num_kv_heads} KV heads over degree {degree}")
    group_size = num_heads // num_kv_heads
    if num_kv_heads % degree == 0:
        q_chunk, kv_chunk = num_heads // degree, num_kv_heads // degree
        return [HeadSlice(i * q_chunk, (i + 1) * q_chunk, i * kv_chunk, (i + 1) * kv_chunk) for i in range(degree)]
    if degree % num_kv_heads == 0:
        ranks_per_kv = degree // num_kv_heads
        out = []
        for kv in range(num_kv_heads):
            bounds = _even_bounds(group_size, ranks_per_kv)
            base = kv * group_size
            out += [HeadSlice(base + a, base + b, kv, kv + 1) for a, b in zip(bounds, bounds[1:])]
        return out
    bounds = _even_bounds(num_heads, degree)
    return [HeadSlice(a, b, a // group_size, (b - 1) // group_size + 1) for a, b in zip(bounds, bounds[1:])]


def _even_bounds(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    bounds = [0]
    for index in range(parts):
        bounds.append(bounds[-1] + base + (1 if index < extra else 0))
    return bounds


def heads_per_rank(num_heads: int, num_kv_heads: int, degree: int) -> tuple[int, ...]:
    """Query heads each rank of a degree-`degree` group holds, in rank order."""
    if degree == 1:
        return (num_heads,)
    return tuple(part.num_q for part in head_partition(num_heads, num_kv_heads, degree))


def kv_heads_held(num_heads: int, num_kv_heads: int, degree: int) -> int:
    """KV heads summed over the group's ranks (> num_kv_heads where KV heads are replicated)."""
    if degree == 1:
        return num_kv_heads
    return sum(part.num_kv for part in head_partition(num_heads, num_kv_heads, degree))


def max_degree_for_heads(num_heads: int) -> int:
    """The largest power of two ≤ `num_heads` (every rank of a pack needs one query head)."""
    return 1 << (max(num_heads, 1).bit_length() - 1)
