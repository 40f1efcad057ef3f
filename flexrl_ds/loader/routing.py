"""Pure routing and slicing rules of ShadowLoader (no Ray, no torch).

- `LoadTracker` / `least_loaded`: which preprocessing actor gets the next prompt. An actor's load is
  the predicted cost (vision patches) of the prompts it has been given and not yet finished; the
  next prompt goes to the live actor with the smallest load, ties broken by actor name, so routing
  is deterministic for a given order of prompts.
- `chunk_ranges` / `chunks_covering`: how a video's temporal patch groups are cut into cached
  slices, and which slices a request for groups [start, end) needs. An image is one slice of one
  temporal group.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def least_loaded(loads: Mapping[str, float], alive: Iterable[str] | None = None) -> str:
    """The actor with the smallest load among `alive` (default: all of `loads`); ties by name."""
    candidates = sorted(loads if alive is None else alive)
    if not candidates:
        raise ValueError("no live preprocessing actor to route to")
    return min(candidates, key=lambda name: (loads.get(name, 0.0), name))


def route_greedy(costs: Sequence[float], loads: Mapping[str, float]) -> list[str]:
    """Route tasks of `costs`, in order, each to the currently least-loaded actor.

    Returns the chosen actor per task; `loads` is not modified (the caller's tracker is).
    """
    running = dict(loads)
    chosen = []
    for cost in costs:
        if cost < 0:
            raise ValueError(f"task cost must be non-negative, got {cost}")
        name = least_loaded(running)
        running[name] += cost
        chosen.append(name)
    return chosen


class LoadTracker:
    """Outstanding predicted cost per live actor; the controller's view used for routing."""

    def __init__(self, actor_names: Iterable[str]):
        self._loads: dict[str, float] = {name: 0.0 for name in actor_names}
        if not self._loads:
            raise ValueError("LoadTracker needs at least one actor")
        self._dead: set[str] = set()

    @property
    def alive(self) -> list[str]:
        return sorted(self._loads)

    @property
    def dead(self) -> list[str]:
        return sorted(self._dead)

    def load(self, name: str) -> float:
        return self._loads[name]

    def assign(self, cost: float) -> str:
        """Pick the least-loaded live actor and charge it `cost`."""
        name = least_loaded(self._loads)
        self._loads[name] += cost
        return name

    def finish(self, name: str, cost: float) -> None:
        """Credit `cost` back to `name` (ignored for an actor already marked dead)."""
        if name in self._loads:
            self._loads[name] = max(0.0, self._loads[name] - cost)

    def mark_dead(self, name: str) -> None:
        """Stop routing to `name`; routing fails once no actor is left alive."""
        self._loads.pop(name, None)
        self._dead.add(name)


def chunk_ranges(num_groups: int, groups_per_chunk: int) -> list[tuple[int, int]]:
    """Cut temporal groups [0, num_groups) into consecutive [start, end) chunks."""
    if num_groups < 1:
        raise ValueError(f"a media item needs at least one temporal group, got {num_groups}")
    if groups_per_chunk < 1:
        raise ValueError(f"groups_per_chunk must be at least 1, got {groups_per_chunk}")
    return [(start, min(start + groups_per_chunk, num_groups)) for start in range(0, num_groups, groups_per_chunk)]


def chunks_covering(ranges: Sequence[tuple[int, int]], start: int, end: int) -> list[int]:
    """Indices of the chunks in `ranges` that overlap groups [start, end)."""
    total = ranges[-1][1] if ranges else 0
    if not 0 <= start < end <= total:
        raise ValueError(f"temporal range [{start}, {end}) is outside [0, {total})")
    return [index for index, (lo, hi) in enumerate(ranges) if lo < end and start < hi]
