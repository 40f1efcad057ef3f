"""Host memory of this process's node, as Ray's memory monitor counts it: in use = total - available.

Ray kills workers once a node's memory in use passes `RAY_memory_usage_threshold` (0.95 of the
node's memory unless set); a 7B policy with its optimizer offloaded to pinned host memory came
within a few GiB of that on a 125 GiB node (docs/BENCHMARKS.md). Each policy rank samples these
into its per-phase peaks (`PolicyWorker.peaks`), and the driver warns near the threshold.
"""

from __future__ import annotations

import os

import psutil

NEAR_LIMIT_SHARE = 0.9
"""A phase whose node memory in use peaks above this share of the node's memory is warned about."""


def bytes_in_use() -> int:
    """Bytes in use on this node now (total - available, page cache not counted)."""
    memory = psutil.virtual_memory()
    return int(memory.total - memory.available)


def bytes_total() -> int:
    return int(psutil.virtual_memory().total)


def ray_kill_share() -> float:
    """The share of a node's memory above which Ray's memory monitor kills workers."""
    try:
        return float(os.environ.get("RAY_memory_usage_threshold", "0.95"))
    except ValueError:
        return 0.95
