"""The node's host memory in use, as each policy rank reports it per phase, and the driver's warning
near the share at which Ray's memory monitor kills workers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flexrl_ds.parallel.device import DeviceUsageMonitor
from flexrl_ds.runtime import host_memory
from flexrl_ds.trainer import policy_worker
from flexrl_ds.trainer.driver import warn_host_memory
from flexrl_ds.trainer.policy_worker import PolicyWorker

GIB = 2**30


def meminfo_bytes(field: str) -> int:
    for line in open("/proc/meminfo"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def test_in_use_is_what_proc_meminfo_says():
    """total - available, as Ray's memory monitor counts it (the machine's use moves: 0.5 GiB slack)."""
    assert host_memory.bytes_total() == pytest.approx(meminfo_bytes("MemTotal"), rel=1e-3)
    expected = meminfo_bytes("MemTotal") - meminfo_bytes("MemAvailable")
    assert abs(host_memory.bytes_in_use() - expected) < GIB / 2


def test_a_rank_reports_its_nodes_peak_and_share(monkeypatch):
    cpu = SimpleNamespace(is_gpu=False)
    readings = [30 * GIB, 70 * GIB]  # at the reset, a sample in the phase; 50 GiB from then on (the report)
    in_use = lambda: readings.pop(0) if readings else 50 * GIB  # noqa: E731
    rank = PolicyWorker.__new__(PolicyWorker)
    rank.device_info, rank.allocator_at_reset = cpu, {"alloc_retries": 0, "device_mallocs": 0}
    rank.device_usage = DeviceUsageMonitor(cpu, poll=False)
    rank.host_usage = DeviceUsageMonitor(cpu, used_bytes=in_use, poll=False)
    monkeypatch.setattr(policy_worker.host_memory, "bytes_total", lambda: 100 * GIB)
    rank.host_usage.reset()
    rank.host_usage.sample()
    peaks = rank.peaks()
    assert peaks["peak_host_used_gb"] == 70 and peaks["peak_host_used_share"] == pytest.approx(0.7)
    assert peaks["peak_device_used_gb"] == 0  # a CPU rank's device monitor is inert


@pytest.mark.parametrize("share", [0.5, 0.91])
def test_the_driver_warns_only_near_rays_kill_threshold(capsys, monkeypatch, share):
    monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)
    warn_host_memory("update", {"peak_host_used_gb": share * 125, "peak_host_used_share": share})
    said = capsys.readouterr().out
    if share < host_memory.NEAR_LIMIT_SHARE:
        assert said == ""
        return
    assert said.startswith("memory: update: host memory in use peaked at 114 GiB, 91% of a policy rank's node")
    assert "kills workers above 95%" in said and "offload_optimizer.ratio" in said
