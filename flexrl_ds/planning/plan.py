"""Workload and plan files: the contract between planner, executor, benchmarks and outside checkers.

Formats are exactly those of `docs/PLAN_SCHEMA.md` (unknown fields are ignored on read).
Pure module: no torch, no torch.distributed, no Ray.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from flexrl_ds.common import is_power_of_two
from flexrl_ds.common.json_files import read_json
from flexrl_ds.common.output_files import output_file


@dataclass(frozen=True)
class SequenceSpec:
    """One sequence of a step as the planner sees it (a workload-file entry)."""

    id: str
    tokens: int
    """Full LLM sequence length: prompt text + vision tokens + response."""
    vision_tokens: int = 0
    """Merged vision tokens inside `tokens`."""
    images: int = 0
    frames: int = 0


@dataclass(frozen=True)
class Workload:
    sequences: tuple[SequenceSpec, ...]

    def by_id(self) -> dict[str, SequenceSpec]:
        return {seq.id: seq for seq in self.sequences}

    def to_json(self) -> dict[str, Any]:
        return {
            "sequences": [
                {"id": s.id, "tokens": s.tokens, "vision_tokens": s.vision_tokens, "images": s.images,
                 "frames": s.frames}
                for s in self.sequences
            ]
        }


def _require_count(entry: Mapping[str, Any], key: str, where: str, minimum: int) -> int:
    value = entry.get(key, 0 if minimum == 0 else None)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{where}: {key!r} must be >= {minimum}, got {value}")
    return value


def parse_workload(raw: Any, source: str = "workload") -> Workload:
    """Validate a workload object; errors name the sequence (by id or index) and the field."""
    if not isinstance(raw, dict) or not isinstance(raw.get("sequences"), list):
        raise ValueError(f"{source}: expected an object with a 'sequences' list")
    if not raw["sequences"]:
        raise ValueError(f"{source}: the workload is empty (no sequences)")
    seen: set[str] = set()
    sequences = []
    for index, entry in enumerate(raw["sequences"]):
        where = f"{source}: sequence #{index}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object, got {type(entry).__name__}")
        seq_id = entry.get("id")
        if not isinstance(seq_id, str) or not seq_id:
            raise ValueError(f"{where}: 'id' must be a non-empty string, got {seq_id!r}")
        where = f"{source}: sequence {seq_id!r}"
        if seq_id in seen:
            raise ValueError(f"{where}: duplicate id")
        seen.add(seq_id)
        tokens = _require_count(entry, "tokens", where, 1)
        vision_tokens = _require_count(entry, "vision_tokens", where, 0)
        if vision_tokens > tokens:
            raise ValueError(f"{where}: vision_tokens ({vision_tokens}) exceeds tokens ({tokens})")
        sequences.append(
            SequenceSpec(
                id=seq_id,
                tokens=tokens,
                vision_tokens=vision_tokens,
                images=_require_count(entry, "images", where, 0),
                frames=_require_count(entry, "frames", where, 0),
            )
        )
    return Workload(tuple(sequences))


def load_workload(path: str | Path) -> Workload:
    return parse_workload(read_json(path, "workload"), source=str(path))


@dataclass(frozen=True)
class Pack:
    """Sequences executed together by one aligned device group of `degree` ranks."""

    id: int
    degree: int
    ranks: tuple[int, ...]
    sequences: tuple[str, ...]
    heads: tuple[int, ...] = ()
    """Query heads each rank of `ranks` holds, in that order (the executor's split); () when unknown
    (plan files written before this field)."""

    @property
    def group_index(self) -> int:
        """k for the aligned block [k*degree, (k+1)*degree)."""
        return self.ranks[0] // self.degree


@dataclass(frozen=True)
class Plan:
    world_size: int
    p_max: int
    packs: tuple[Pack, ...]
    rank_order: dict[int, tuple[int, ...]]
    """rank -> pack ids in collective-issue (HSF) order."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Additional fields written to / read from the plan file (metrics, options); free-form."""

    def pack_by_id(self) -> dict[int, Pack]:
        return {pack.id: pack for pack in self.packs}

    def packs_of_rank(self, rank: int) -> list[Pack]:
        """This rank's packs in execution order."""
        packs = self.pack_by_id()
        return [packs[pack_id] for pack_id in self.rank_order.get(rank, ())]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "world_size": self.world_size,
            "p_max": self.p_max,
            "packs": [
                {"id": p.id, "degree": p.degree, "ranks": list(p.ranks), "sequences": list(p.sequences),
                 **({"heads": list(p.heads)} if p.heads else {})}
                for p in self.packs
            ],
            "rank_order": {str(r): list(self.rank_order.get(r, ())) for r in range(self.world_size)},
        }
        for key, value in self.extra.items():
            out.setdefault(key, value)
        return out

    def save(self, path: str | Path) -> None:
        output_file(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")


def parse_plan(raw: Any, source: str = "plan") -> Plan:
    """Read a plan object (types only; `validate_plan` checks the schema's invariants)."""
    try:
        packs = tuple(
            Pack(id=int(p["id"]), degree=int(p["degree"]), ranks=tuple(int(r) for r in p["ranks"]),
                 sequences=tuple(str(s) for s in p["sequences"]), heads=tuple(int(h) for h in p.get("heads", ())))
            for p in raw["packs"]
        )
        rank_order = {int(r): tuple(int(i) for i in ids) for r, ids in raw["rank_order"].items()}
        known = {"world_size", "p_max", "packs", "rank_order"}
        extra = {k: v for k, v in raw.items() if k not in known}
        return Plan(world_size=int(raw["world_size"]), p_max=int(raw["p_max"]), packs=packs,
                    rank_order=rank_order, extra=extra)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"{source}: malformed plan ({type(error).__name__}: {error})") from None


def load_plan(path: str | Path) -> Plan:
    return parse_plan(read_json(path, "plan"), source=str(path))


def validate_plan(plan: Plan, workload: Workload | Iterable[str] | None = None) -> None:
    """Check every invariant of docs/PLAN_SCHEMA.md; raise ValueError naming the first violation.

    Deadlock freedom of `rank_order` beyond the HSF rules is checked by the schedule simulator.
    """
    if plan.world_size < 1:
        raise ValueError(f"plan: world_size must be >= 1, got {plan.world_size}")
    if not is_power_of_two(plan.p_max):
        raise ValueError(f"plan: p_max {plan.p_max} is not a power of two")
    ids = [p.id for p in plan.packs]
    if len(set(ids)) != len(ids):
        raise ValueError("plan: duplicate pack ids")
    placed: dict[str, int] = {}
    for pack in plan.packs:
        where = f"plan: pack {pack.id}"
        if not is_power_of_two(pack.degree) or pack.degree > plan.p_max or pack.degree > plan.world_size:
            raise ValueError(f"{where}: degree {pack.degree} is not a power of two <= p_max and world_size")
        start = pack.ranks[0] if pack.ranks else -1
        if start % pack.degree != 0 or pack.ranks != tuple(range(start, start + pack.degree)) \
                or start + pack.degree > plan.world_size:
            raise ValueError(f"{where}: ranks {list(pack.ranks)} are not an aligned block of {pack.degree}")
        if not pack.sequences:
            raise ValueError(f"{where}: has no sequences")
        if pack.heads and (len(pack.heads) != pack.degree or min(pack.heads) < 1):
            raise ValueError(f"{where}: heads {list(pack.heads)} must give >= 1 query head to each of its "
                             f"{pack.degree} ranks")
        for seq_id in pack.sequences:
            if seq_id in placed:
                raise ValueError(f"plan: sequence {seq_id!r} is in packs {placed[seq_id]} and {pack.id}")
            placed[seq_id] = pack.id
    if workload is not None:
        expected = [s.id for s in workload.sequences] if isinstance(workload, Workload) else list(workload)
        missing = [s for s in expected if s not in placed]
        unknown = [s for s in placed if s not in set(expected)]
        if missing:
            raise ValueError(f"plan: sequence {missing[0]!r} is not placed ({len(missing)} missing)")
        if unknown:
            raise ValueError(f"plan: sequence {unknown[0]!r} is not in the workload")
    _validate_rank_order(plan)


def _validate_rank_order(plan: Plan) -> None:
    packs = plan.pack_by_id()
    bad_ranks = [r for r in plan.rank_order if not 0 <= r < plan.world_size]
    if bad_ranks:
        raise ValueError(f"plan: rank_order names rank {bad_ranks[0]} outside world_size {plan.world_size}")
    for rank in range(plan.world_size):
        order = plan.rank_order.get(rank, ())
        expected = sorted(p.id for p in plan.packs if rank in p.ranks)
        if sorted(order) != expected:
            raise ValueError(f"plan: rank_order[{rank}] lists {sorted(order)}, but its packs are {expected}")
        degrees = [packs[i].degree for i in order]
        if any(a < b for a, b in zip(degrees, degrees[1:])):
            raise ValueError(f"plan: rank_order[{rank}] is not Highest-Sharding-First (degrees {degrees})")
    # Packs of equal degree on the same group: same relative order on all of its ranks.
    reference: dict[tuple[int, int], list[int]] = {}
    for rank in range(plan.world_size):
        per_group: dict[tuple[int, int], list[int]] = {}
        for pack_id in plan.rank_order.get(rank, ()):
            pack = packs[pack_id]
            per_group.setdefault((pack.degree, pack.ranks[0]), []).append(pack_id)
        for key, group_order in per_group.items():
            if reference.setdefault(key, group_order) != group_order:
                raise ValueError(
                    f"plan: packs of degree {key[0]} on ranks starting at {key[1]} run in different "
                    f"orders on different ranks ({reference[key]} vs {group_order} on rank {rank})"
                )
