"""Nested sequence-parallel group tree: one process group per aligned power-of-two block.

FlexUlysses gives each pack of sequences its own Ulysses degree `d` and runs it on the aligned block
of ranks `[k*d, (k+1)*d)` of an SP domain (docs/PLAN_SCHEMA.md). Any two such blocks are disjoint or
nested, which is what makes the Highest-Sharding-First order deadlock free. torch.distributed needs
every subgroup created once, by every rank of the world, in the same order; `GroupTree.create` does
exactly that at start-up and then answers `group_for(degree, first_rank)` without collectives.

Besides the blocks, every domain gets one domain-wide group, `GroupTree.domain_group`: the group of
the exchanges that span the whole domain whatever the plan's degrees (the vision embedding
all-to-all, models/vision_balance.py). It is the degree-`domain_size` block when p_max reaches the
domain size, else a group of its own, created after all blocks (`SPTopology.domain_groups_to_create`).

`SPTopology` is the pure half: sizes and rank arithmetic, validated without a process group (in the
spirit of torchtitan's ParallelDims), so bad configurations fail before any group is created.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flexrl_ds.common import is_power_of_two


@dataclass(frozen=True)
class SPTopology:
    """World split into sequence-parallel domains (= data-parallel replicas) of `domain_size` ranks."""

    world_size: int
    """Number of processes in the job."""
    domain_size: int
    """Ranks of one SP domain; plans use ranks 0..domain_size-1 inside a domain. Divides world_size."""
    p_max: int
    """Largest Ulysses degree; a power of two, at most domain_size. Groups exist for 2..p_max."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"SP topology: world_size must be >= 1, got {self.world_size}")
        if self.domain_size < 1 or self.world_size % self.domain_size != 0:
            raise ValueError(
                f"SP topology: domain_size {self.domain_size} does not divide world_size {self.world_size}")
        if not is_power_of_two(self.p_max):
            raise ValueError(f"SP topology: p_max {self.p_max} is not a power of two")
        if self.p_max > self.domain_size:
            raise ValueError(f"SP topology: p_max {self.p_max} exceeds domain_size {self.domain_size}")

    @property
    def num_domains(self) -> int:
        return self.world_size // self.domain_size

    def domain_of(self, global_rank: int) -> int:
        self._check_rank(global_rank)
        return global_rank // self.domain_size

    def local_rank(self, global_rank: int) -> int:
        """Rank inside its SP domain (the rank numbering plans use)."""
        self._check_rank(global_rank)
        return global_rank % self.domain_size

    def degrees(self) -> list[int]:
        """Degrees that get a process group: 2, 4, ..., p_max (degree 1 needs no communication)."""
        out, degree = [], 2
        while degree <= self.p_max:
            out.append(degree)
            degree *= 2
        return out

    def blocks(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """Every (domain, degree, global ranks) block, in the creation order all ranks must follow."""
        out = []
        for domain in range(self.num_domains):
            base = domain * self.domain_size
            for degree in self.degrees():
                for first in range(0, self.domain_size - degree + 1, degree):
                    out.append((domain, degree, tuple(range(base + first, base + first + degree))))
        return out

    def domain_ranks(self, domain: int) -> tuple[int, ...]:
        """Global ranks of SP domain `domain`."""
        if not 0 <= domain < self.num_domains:
            raise ValueError(f"SP topology: domain {domain} outside {self.num_domains} domains")
        return tuple(range(domain * self.domain_size, (domain + 1) * self.domain_size))

    def domain_groups_to_create(self) -> list[tuple[int, tuple[int, ...]]]:
        """(domain, global ranks) of the domain-wide groups that no block provides (p_max < domain_size,
        or a domain of one rank), in creation order; created after every block."""
        if self.p_max == self.domain_size and self.domain_size > 1:
            return []
        return [(domain, self.domain_ranks(domain)) for domain in range(self.num_domains)]

    def _check_rank(self, global_rank: int) -> None:
        if not 0 <= global_rank < self.world_size:
            raise ValueError(f"SP topology: rank {global_rank} outside world_size {self.world_size}")


@dataclass
class GroupTree:
    """Process groups of one rank's SP domain, keyed by (degree, first domain-local rank).

    Build with `GroupTree.create(topology, rank)` on every rank (it creates the groups of all domains
    in one fixed order, as torch.distributed requires). Held explicitly and passed down; never global.
    """

    topology: SPTopology
    """Sizes this tree was built for."""
    rank: int
    """This process's global rank."""
    groups: dict[tuple[int, int], Any] = field(default_factory=dict)
    """(degree, first domain-local rank) -> ProcessGroup, for the blocks of this rank's domain."""
    domain_group: Any = None
    """The ProcessGroup of this rank's whole SP domain (set by `create`; a block's group when p_max
    equals domain_size). What the vision exchange runs on: never the world group when there are
    several domains."""

    @property
    def domain(self) -> int:
        return self.topology.domain_of(self.rank)

    @property
    def local_rank(self) -> int:
        """This rank inside its SP domain (what plans call a rank)."""
        return self.topology.local_rank(self.rank)

    def global_rank(self, local_rank: int) -> int:
        """Global rank of domain-local rank `local_rank` of this rank's domain."""
        return self.domain * self.topology.domain_size + local_rank

    @classmethod
    def create(cls, topology: SPTopology, rank: int, backend: str | None = None) -> "GroupTree":
        """Create every block's group (collective over the world: all ranks must call this)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("GroupTree.create: torch.distributed is not initialized")
        if dist.get_world_size() != topology.world_size:
            raise ValueError(f"GroupTree.create: the job has {dist.get_world_size()} ranks but the "
                             f"SP topology says world_size={topology.world_size}")
        tree = cls(topology=topology, rank=rank)
        my_domain = topology.domain_of(rank)
        for domain, degree, ranks in topology.blocks():
            group = dist.new_group(list(ranks), backend=backend)
            if domain == my_domain:
                tree.groups[(degree, ranks[0] - domain * topology.domain_size)] = group
        tree.domain_group = tree.groups.get((topology.domain_size, 0))
        for domain, ranks in topology.domain_groups_to_create():
            group = dist.new_group(list(ranks), backend=backend)
            if domain == my_domain:
                tree.domain_group = group
        return tree

    def has_group(self, degree: int, first_rank: int) -> bool:
        """True if a block of `degree` starting at domain-local `first_rank` is in the tree."""
        return degree == 1 and 0 <= first_rank < self.topology.domain_size or (degree, first_rank) in self.groups

    def group_for(self, degree: int, first_rank: int):
        """The group of the aligned block [first_rank, first_rank+degree) (domain-local ranks).

        Degree 1 returns None: a single rank runs its pack without communication.
        """
        if degree == 1 and 0 <= first_rank < self.topology.domain_size:
            return None
        try:
            return self.groups[(degree, first_rank)]
        except KeyError:
            raise ValueError(
                f"group tree: no group of degree {degree} starting at rank {first_rank} "
                f"(p_max={self.topology.p_max}, domain_size={self.topology.domain_size})") from None
