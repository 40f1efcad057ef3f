"""The node's host memory in use, as each policy rank reports it per phase, and the driver's warning
near the share at which Ray's memory monitor kills workers."""

from __future__ import annotations

import gc
import time
from types import SimpleNamespace

import pytest

from flexrl_ds.parallel.device import DeviceUsageMonitor
from flexrl_ds.runtime import host_memory
from flexrl_ds.runtime.gc_pauses import GCPauses
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
    limited = host_memory.cgroup_memory()
    if limited is not None and limited.total < meminfo_bytes("MemTotal"):
        pytest.skip("a memory cgroup limits this process: what counts is the cgroup's (tested with made-up files)")
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
    rank.gc_pauses = GCPauses()
    monkeypatch.setattr(policy_worker.host_memory, "bytes_total", lambda: 100 * GIB)
    gc.disable()  # no collection in the phase but the one timed here
    try:
        rank.reset_peaks()  # the driver's, before the phase: reads 30 GiB
        rank.host_usage.sample()  # the monitor's thread, during the phase: 70 GiB
        started = time.perf_counter()
        gc.collect()  # a full collection in the phase
        collected = time.perf_counter() - started
        peaks = rank.peaks()
    finally:
        gc.enable()
        rank.gc_pauses.close()
    assert peaks["peak_host_used_gb"] == 70 and peaks["peak_host_used_share"] == pytest.approx(0.7)
    assert peaks["peak_device_used_gb"] == 0  # a CPU rank's device monitor is inert
    assert 0 < peaks["gc_pause_s"] <= collected


def test_a_new_phase_starts_a_new_peak():
    """`reset_peaks` forgets the last phase's host peak: a phase after a high one reports its own."""
    cpu = SimpleNamespace(is_gpu=False)
    in_use = [80 * GIB]
    rank = PolicyWorker.__new__(PolicyWorker)
    rank.device_info, rank.allocator_at_reset = cpu, {"alloc_retries": 0, "device_mallocs": 0}
    rank.device_usage = DeviceUsageMonitor(cpu, poll=False)
    rank.host_usage = DeviceUsageMonitor(cpu, used_bytes=lambda: in_use[0], poll=False)
    rank.gc_pauses = GCPauses()
    rank.reset_peaks()
    assert rank.peaks()["peak_host_used_gb"] == 80
    in_use[0] = 20 * GIB
    rank.reset_peaks()
    assert rank.peaks()["peak_host_used_gb"] == 20
    rank.gc_pauses.close()


@pytest.mark.parametrize("share, kill, warned", [(0.5, None, False), (0.91, None, True), (0.82, "0.85", True),
                                                 (0.78, "0.85", False)])
def test_the_driver_warns_near_rays_kill_threshold(capsys, monkeypatch, share, kill, warned):
    """Above 90% of the node, or 5 points under Ray's kill share where that is set lower."""
    if kill is None:
        monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)
    else:
        monkeypatch.setenv("RAY_memory_usage_threshold", kill)
    hint = "A policy rank's host memory holds the offloaded optimizer (ratio 0.6)"
    warn_host_memory("update", {"peak_host_used_gb": share * 125, "peak_host_used_share": share}, hint)
    said = capsys.readouterr().out
    assert bool(said) is warned
    if warned:
        assert said.startswith(f"memory: update: host memory in use peaked at {share * 125:.0f} GiB, "
                               f"{share:.0%} of a policy rank's node")
        assert f"kills workers above {float(kill or 0.95):.0%}. {hint}" in said


def test_the_warning_says_when_no_setting_keeps_states_in_host_memory(capsys, monkeypatch):
    import json
    from pathlib import Path

    from flexrl_ds.config.flexrl_config import parse_run_config
    from flexrl_ds.trainer.launch import policy_memory_hint

    monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)
    raw = json.loads((Path(__file__).parents[3] / "ds_configs" / "grpo_vl3b_1xh200.json").read_text())
    raw["flexrl"]["rollout"].setdefault("vllm", {})["sleep_level"] = 2  # its optimizer stays on the GPU
    run = parse_run_config(raw)
    warn_host_memory("rollout", {"peak_host_used_gb": 120.0, "peak_host_used_share": 0.96}, policy_memory_hint(run))
    said = capsys.readouterr().out
    assert "None of the run's settings that put a policy rank's states in host memory is on" in said
    assert "offload_optimizer / offload_param" in said


def test_without_a_hint_the_warning_ends_at_rays_kill_share(capsys, monkeypatch):
    monkeypatch.delenv("RAY_memory_usage_threshold", raising=False)
    warn_host_memory("update", {"peak_host_used_gb": 120.0, "peak_host_used_share": 0.96})
    assert capsys.readouterr().out.endswith("Ray's memory monitor kills workers above 95%.\n")


def test_host_figures_come_from_the_node_closest_to_its_limit():
    """Ranks on nodes of different sizes: the GiB and the share reported together are one node's."""
    from flexrl_ds.trainer.driver import _max_peaks

    big = {"peak_device_used_gb": 70.0, "peak_host_used_gb": 240.0, "peak_host_used_share": 0.48}  # of 500 GiB
    small = {"peak_device_used_gb": 60.0, "peak_host_used_gb": 115.0, "peak_host_used_share": 0.92}  # of 125 GiB
    peaks = _max_peaks([big, small])
    assert (peaks["peak_host_used_gb"], peaks["peak_host_used_share"]) == (115.0, 0.92)
    assert peaks["peak_device_used_gb"] == 70.0  # device peaks: the most of any rank


def write_cgroup(folder, files: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


@pytest.mark.parametrize("version", ["v2", "v1"])
def test_a_memory_cgroup_below_the_machine_is_what_counts(tmp_path, version):
    """Like Ray: the cgroup's limit, and its usage less inactive file pages (the kernel reclaims them)."""
    if version == "v2":
        write_cgroup(tmp_path, {"memory.max": f"{8 * GIB}\n", "memory.current": f"{5 * GIB}\n",
                                "memory.stat": f"anon {3 * GIB}\ninactive_file {GIB}\n"})
    else:
        write_cgroup(tmp_path / "memory", {"memory.limit_in_bytes": f"{8 * GIB}\n", "memory.usage_in_bytes": f"{5 * GIB}\n",
                                           "memory.stat": f"inactive_file 7\ntotal_inactive_file {GIB}\n"})
    assert host_memory.cgroup_memory(tmp_path) == (4 * GIB, 8 * GIB)
    assert host_memory.host_memory(tmp_path) == (4 * GIB, 8 * GIB)  # 8 GiB is below this machine's memory


def test_an_unlimited_or_absent_cgroup_leaves_the_machine(tmp_path):
    assert host_memory.cgroup_memory(tmp_path) is None  # no cgroup files
    write_cgroup(tmp_path, {"memory.max": "max\n", "memory.current": "5\n", "memory.stat": "inactive_file 1\n"})
    assert host_memory.cgroup_memory(tmp_path) is None
    assert host_memory.host_memory(tmp_path).total == pytest.approx(meminfo_bytes("MemTotal"), rel=1e-3)
    v1 = tmp_path / "v1"  # cgroup v1 without a limit: the largest page-aligned number
    write_cgroup(v1 / "memory", {"memory.limit_in_bytes": f"{2**63 - 4096}\n", "memory.usage_in_bytes": "5\n",
                                 "memory.stat": "total_inactive_file 1\n"})
    assert host_memory.cgroup_memory(v1) == (4, 2**63 - 4096)
    assert host_memory.host_memory(v1).total == pytest.approx(meminfo_bytes("MemTotal"), rel=1e-3)
