"""Host memory of this process's node, counted the way Ray's memory monitor counts it.

Ray kills workers once a node's memory in use passes `RAY_memory_usage_threshold` (0.95 unless
set); a 7B policy with its optimizer offloaded to pinned host memory came within a few GiB of that
on a 125 GiB node (docs/BENCHMARKS.md, "Memory settings and what each costs"). Like Ray, where a
memory cgroup limits the process below the machine's memory (a container, a Kubernetes pod), the
cgroup's limit and usage (less its inactive file pages) are what count; otherwise the machine's
total - available. Each policy rank samples this into its per-phase peaks (`PolicyWorker.peaks`),
and the driver warns near the threshold.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import psutil

CGROUP_ROOT = Path("/sys/fs/cgroup")

WARN_SHARE = 0.9
"""A phase whose memory in use peaks above this share of its node's (or below Ray's kill share, if
that is lower: `warn_share`) is warned about."""


class HostMemory(NamedTuple):
    used: int
    """Bytes in use."""
    total: int
    """Bytes the process may use: the machine's, or its memory cgroup's limit where lower."""


def cgroup_memory(root: Path = CGROUP_ROOT) -> HostMemory | None:
    """The memory cgroup's limit and usage (less inactive file pages, which the kernel reclaims),
    cgroup v2 first, then v1; None without a limit or a readable cgroup."""
    layouts = ((root, "memory.max", "memory.current", "inactive_file"),
               (root / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
    for folder, limit_file, usage_file, inactive_key in layouts:
        try:
            limit_text = (folder / limit_file).read_text().strip()
            usage = int((folder / usage_file).read_text())
            stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if line.strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max":
            return None
        return HostMemory(max(0, usage - int(stat.get(inactive_key, 0))), int(limit_text))
    return None


def host_memory(root: Path = CGROUP_ROOT) -> HostMemory:
    """Memory in use and its total on this node, as Ray's memory monitor sees this process."""
    machine = psutil.virtual_memory()
    limited = cgroup_memory(root)
    if limited is not None and limited.total < machine.total:
        return limited
    return HostMemory(int(machine.total - machine.available), int(machine.total))


def bytes_in_use() -> int:
    return host_memory().used


def bytes_total() -> int:
    return host_memory().total


def ray_kill_share() -> float:
    """The share of a node's memory above which Ray's memory monitor kills workers (the threshold
    this process's environment names; Ray's default 0.95)."""
    try:
        return float(os.environ.get("RAY_memory_usage_threshold", "0.95"))
    except ValueError:
        return 0.95


def warn_share() -> float:
    """The share above which a phase's peak is warned about: WARN_SHARE, or 0.05 under Ray's kill
    share where that is set lower."""
    return min(WARN_SHARE, ray_kill_share() - 0.05)
