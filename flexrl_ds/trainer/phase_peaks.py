"""The memory peaks of a step's phases over the policy ranks (the driver's `peak_*` metrics), and the
warning when a phase's host memory nears the share at which Ray's memory monitor kills workers."""

from __future__ import annotations

import logging
from typing import Any

from flexrl_ds.runtime import host_memory

logger = logging.getLogger(__package__)


PEAK_KEYS = ("peak_memory_gb", "peak_device_used_gb", "alloc_retries", "device_mallocs", "peak_host_used_gb",
             "peak_host_used_share", "peak_pinned_host_gb", "gc_pause_s")
"""What `PolicyWorker.peaks` reports: torch's allocations, all memory in use on the device, torch's
allocator's retries (the cache freed to make room) and device mallocs in the phase, the host
memory in use on a rank's node (GiB, and its share of the node's), the pinned host memory torch's
allocator held for the rank (GiB, blocks as rounded), and the seconds Python's garbage collector
held the rank."""


def warn_host_memory(phase: str, peaks: dict[str, float], memory_hint: str = "") -> None:
    """Say a phase whose node memory in use came near the share at which Ray's memory monitor kills
    workers (runtime/host_memory.py), with what the run's settings keep there (`memory_hint`:
    `launch.policy_memory_hint`)."""
    share = peaks.get("peak_host_used_share", 0.0)
    if share > host_memory.warn_share():
        logger.info(f"memory: {phase}: host memory in use peaked at {peaks['peak_host_used_gb']:.0f} GiB, "
                    f"{share:.0%} of a policy rank's node; Ray's memory monitor kills workers above "
                    f"{host_memory.ray_kill_share():.0%}." + (f" {memory_hint}" if memory_hint else ""))


HOST_PEAK_KEYS = ("peak_host_used_gb", "peak_host_used_share")


def _max_peaks(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """The largest of each device peak over the policy ranks, and the host memory of the rank whose
    node came closest to its limit (its GiB and share together: nodes may differ in size)."""
    peaks = {key: max(entry.get(key, 0.0) for entry in per_rank) for key in PEAK_KEYS if key not in HOST_PEAK_KEYS}
    busiest = max(per_rank, key=lambda entry: entry.get("peak_host_used_share", 0.0))
    peaks.update({key: busiest.get(key, 0.0) for key in HOST_PEAK_KEYS})
    return {key: peaks[key] for key in PEAK_KEYS}


def _phase_peaks(peaks: dict[str, dict[str, float]]) -> dict[str, Any]:
    """{"peak_memory_gb": {phase: GiB}, "peak_device_used_gb": {phase: GiB}, "alloc_retries": {phase:
    n}, "device_mallocs": {phase: n}, "peak_host_used_gb": {phase: GiB}, "peak_host_used_share":
    {phase: share}, "peak_pinned_host_gb": {phase: GiB}, "gc_pause_s": {phase: s}}: the most of any policy
    rank of torch's allocations (device, and pinned host), all
    memory in use on the device (a colocated engine's pool included), torch's allocator's work and
    the garbage collector's pauses in the phase, and the host memory in use on the node closest to
    its limit."""
    return {key: {phase: values[key] for phase, values in peaks.items()} for key in PEAK_KEYS}
