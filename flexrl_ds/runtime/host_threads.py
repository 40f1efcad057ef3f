"""How many host threads a policy rank computes with (its OpenMP and torch intra-op threads).

A Ray actor reserving one CPU starts with `OMP_NUM_THREADS=1` (Ray sets it), so without this a policy
rank's host work ran on one core: DeepSpeed's CPUAdam over the offloaded optimizer share (an OpenMP
loop), and the fp32 gradient copies, norms and clipping that ZeRO-3 offload does with torch on the
host. `deepspeed --hostfile` leaves the variable unset instead, so every rank of a node took all of its
cores. Both launchers now resolve one number per rank here:

- `flexrl.trainer.host_threads_per_rank` when set (> 0);
- else `OMP_NUM_THREADS` as the user set it where `flexrl train` started (the Ray driver's
  environment, or the rank's own under a launcher);
- else the cores this process may run on, less the CPUs the data-loading actors reserve on a node
  (`flexrl.data.pool`), divided by the policy ranks on its node (at least 1).

`apply_host_threads` sets both `OMP_NUM_THREADS` (read by OpenMP runtimes loaded later, such as
DeepSpeed's CPUAdam op) and torch's intra-op threads (the runtime already loaded).
"""
from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HostThreads:
    """A rank's host threads and where the number came from (said in the rank's start line)."""

    threads: int
    reason: str


def user_host_threads(configured: int, environment: Mapping[str, str]) -> HostThreads | None:
    """The user's choice, resolved by the driver before any rank starts: `configured` (> 0), else a
    valid `OMP_NUM_THREADS` of `environment`; None: each rank divides its node's cores."""
    if configured < 0:
        raise ValueError(f"flexrl.trainer.host_threads_per_rank must be >= 0 (0: automatic), got {configured}")
    if configured:
        return HostThreads(configured, "flexrl.trainer.host_threads_per_rank")
    value = environment.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return HostThreads(int(value), "OMP_NUM_THREADS where flexrl train started")
    return None


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


def usable_cores() -> int:
    """The cores this process may be scheduled on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def apply_host_threads(choice: HostThreads) -> None:
    """Make `choice.threads` this process's OpenMP and torch intra-op thread count."""
    import torch

    os.environ["OMP_NUM_THREADS"] = str(choice.threads)
    torch.set_num_threads(choice.threads)
