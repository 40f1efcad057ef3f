"""Pure routing and slicing rules of ShadowLoader (no Ray, no torch).

- `LoadTracker` / `least_loaded`: which preprocessing actor gets the next prompt. An actor's load is
  the predicted cost (vision patches) of the prompts it has been given and not yet finished; the
  next prompt goes to the live actor with the smallest load, ties broken by actor name, so routing
  is deterministic for a given order of prompts.
- `route_near` (what `LoadTracker.assign` applies when it is told where a prompt's pixels will be
  used): prefer an actor on a node that consumes the prompt, unless that actor's load exceeds the
  least-loaded live actor's by more than `slack` times the prompt's own cost; then least-loaded.

  What is knowable at decode time. A prompt is decoded one or more steps before its step is
  trained on (look-ahead), so before the FlexUlysses plan says which rank encodes which of its
  images/frames, and before the driver deals prompts to rollout hosts (by tokenized length). So
  the loader routes on the best information it has when it dispatches, `destinations`: node ->
  weight (e.g. the number of the prompt's samples, or bytes, that node will consume):
  * a caller whose dealing rule is fixed (the loader bench deals samples to ranks by (slot, k))
    passes exact destinations, and node-aware routing then moves no pixel across nodes unless the
    loads force it;
  * otherwise the loader uses the nodes that asked for pixels so far (every `PixelSource` names
    its node), weighted by the bytes each asked for: decode work goes to the nodes where
    consumers run, never to a node without consumers unless its actors are idle and the others
    are overloaded. What the plan then sends across nodes is counted (`MaterializedStep
    .bytes_cross_node`), not re-routed: re-decoding or replicating a prompt once the plan is known
    would cost a second decode (seconds of CPU per video) to save a transfer of its pixels
    (milliseconds on a datacenter network); counting tells whether that trade is ever worth it.
  `slack` is in units of the prompt's cost because both sides of the trade scale with it: going
  local makes the prompt wait behind at most `slack` prompts of its size more than the
  least-loaded actor would, and saves moving its pixels (bytes proportional to that cost).
- `chunk_ranges` / `chunks_covering`: how a video's temporal patch groups are cut into cached
  slices, and which slices a request for groups [start, end) needs. An image is one slice of one
  temporal group.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence


def least_loaded(loads: Mapping[str, float], alive: Iterable[str] | None = None) -> str:
    """The actor with the smallest load among `alive` (default: all of `loads`); ties by name."""
    candidates = sorted(loads if alive is None else alive)
    if not candidates:
        raise ValueError("no live preprocessing actor to route to")
    return min(candidates, key=lambda name: (loads.get(name, 0.0), name))


def route_near(loads: Mapping[str, float], actor_nodes: Mapping[str, str], destinations: Mapping[str, float],
               cost: float, slack: float, alive: Iterable[str] | None = None) -> str:
    """The actor for a prompt of `cost` whose pixels are consumed on `destinations` (node ->
    positive weight): among live actors on a destination node whose load is at most the
    least-loaded live actor's load + `slack` * `cost`, the one on the heaviest node, then the
    least loaded, then by name; if none qualifies (or `destinations` is empty), `least_loaded`."""
    if cost < 0 or slack < 0:
        raise ValueError(f"cost and slack must be non-negative, got cost {cost}, slack {slack}")
    candidates = sorted(loads if alive is None else alive)
    fallback = least_loaded(loads, candidates)
    ceiling = math.inf if math.isinf(slack) else loads.get(fallback, 0.0) + slack * cost
    near = [name for name in candidates
            if destinations.get(actor_nodes.get(name, ""), 0.0) > 0 and loads.get(name, 0.0) <= ceiling]
    if not near:
        return fallback
    return min(near, key=lambda name: (-destinations[actor_nodes[name]], loads.get(name, 0.0), name))


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

    def __init__(self, actor_names: Iterable[str], actor_nodes: Mapping[str, str] | None = None,
                 locality_slack: float = 1.0):
        """`actor_nodes`: actor -> its node (for `route_near`); `locality_slack`: its `slack`."""
        self._loads: dict[str, float] = {name: 0.0 for name in actor_names}
        if not self._loads:
            raise ValueError("LoadTracker needs at least one actor")
        if locality_slack < 0:
            raise ValueError(f"locality_slack must be non-negative, got {locality_slack}")
        self._dead: set[str] = set()
        self.actor_nodes = dict(actor_nodes or {})
        self.locality_slack = locality_slack

    @property
    def alive(self) -> list[str]:
        return sorted(self._loads)

    @property
    def dead(self) -> list[str]:
        return sorted(self._dead)

    def load(self, name: str) -> float:
        return self._loads[name]

    def assign(self, cost: float, destinations: Mapping[str, float] | None = None) -> str:
        """Pick a live actor (`route_near` when `destinations` are given, else the least-loaded)
        and charge it `cost`."""
        if destinations:
            name = route_near(self._loads, self.actor_nodes, destinations, cost, self.locality_slack)
        else:
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
