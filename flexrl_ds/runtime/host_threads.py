"""How many host threads a policy rank computes with (its OpenMP and torch intra-op threads).

A Ray actor reserving one CPU starts with `OMP_NUM_THREADS=1` (Ray sets it), so without this a policy
rank's host work ran on one core: DeepSpeed's CPUAdam over the offloaded optimizer share (an OpenMP
loop), and the fp32 gradient copies, norms and clipping that ZeRO-3 offload does with torch on the
host (on an H100 host one thread took a 60 %-offloaded step from 1.90 to 7.61 s). `deepspeed
--hostfile` leaves the variable unset instead, so every rank of a node took all of its cores. The
environment is no guide to what the user wants: Ray's job supervisor, torchrun and `ray exec` set it
to 1 themselves. So each rank takes

- `flexrl.trainer.host_threads_per_rank` when set (> 0);
- else the cores it may run on (`usable_cores`: its affinity mask and its cgroup's CPU quota), less
  the CPUs the data-loading actors reserve on a node (`flexrl.data.pool`), divided by the policy
  ranks on its node. Those cores are taken as the node's, shared by its ranks (a container's
  cpuset is): under a launcher that binds each rank to cores of its own (Open MPI, `srun
  --cpu-bind`), set the key to their count.

`apply_host_threads` sets `OMP_NUM_THREADS` (for processes the rank starts) and torch's intra-op
threads. torch's wheel ships the OpenMP runtime that DeepSpeed's CPUAdam op links against too, so
the count holds for the thread that sets it: a Ray actor without concurrency runs every call on
that one thread (tests/ray/test_host_threads_ray.py checks a later call).
"""
from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
"""cgroup v2's CPU quota of this process's group: "<quota> <period>" or "max <period>"."""


@dataclass(frozen=True)
class HostThreads:
    """A rank's host threads and where the number came from (said in the rank's start line)."""

    threads: int
    reason: str


def configured_host_threads(configured: int) -> HostThreads | None:
    """`flexrl.trainer.host_threads_per_rank` when set; None: each rank divides its node's cores."""
    return HostThreads(configured, "flexrl.trainer.host_threads_per_rank") if configured > 0 else None


def automatic_host_threads(cores: int, ranks_on_node: int, cpus_for_loaders: float = 0.0) -> HostThreads:
    """The node's cores, less those its data-loading actors reserve, shared by the policy ranks on it
    (at least one thread each)."""
    ranks = max(1, ranks_on_node)
    left = max(0, cores - math.ceil(cpus_for_loaders))
    plural = "s" if ranks > 1 else ""
    loaders = f" - {math.ceil(cpus_for_loaders)} for the data loaders" if cpus_for_loaders > 0 else ""
    return HostThreads(max(1, left // ranks), f"({cores} cores{loaders}) / {ranks} policy rank{plural} on this node")


def ranks_per_node(node_ids: Sequence[str]) -> list[int]:
    """For each rank (in order), how many ranks share its node."""
    counts = Counter(node_ids)
    return [counts[node] for node in node_ids]


def cgroup_cpu_quota(cpu_max: Path = CGROUP_CPU_MAX) -> int | None:
    """Whole CPUs of the cgroup's quota (at least 1); None without a quota or cgroup v2."""
    try:
        quota, period = cpu_max.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max" or not quota.isdecimal() or not period.isdecimal() or int(period) == 0:
        return None
    return max(1, int(quota) // int(period))


def usable_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The cores this process may run on: its affinity mask, capped by its cgroup's CPU quota."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        allowed = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cpu_max)
    return min(allowed, quota) if quota else allowed


def apply_host_threads(choice: HostThreads) -> None:
    """Make `choice.threads` this thread's OpenMP and torch intra-op thread count, and the count of the
    processes it starts."""
    os.environ["OMP_NUM_THREADS"] = str(choice.threads)
    torch.set_num_threads(choice.threads)
