"""DeviceUsageMonitor's peaks (parallel/device.py), driven by hand (`poll=False`, `used_bytes` given):
a phase's peak since `reset`, a window's since `start_window`, and a sample read while a reset or a
window's start happened counting for neither new peak."""

from __future__ import annotations

from types import SimpleNamespace

from flexrl_ds.parallel.device import DeviceUsageMonitor

CPU = SimpleNamespace(is_gpu=False)


def scripted(values: list[int], during_next_read=None):
    """A `used_bytes` returning `values` in turn; `during_next_read()` runs inside the next read,
    before it returns (as a reset on the driver's thread would, while the sampling thread reads)."""
    hooks = [during_next_read] if during_next_read else []

    def used() -> int:
        if hooks:
            hooks.pop()()
        return values.pop(0)
    return used


def test_phase_and_window_peaks():
    values = [10, 30, 20, 50, 40, 70, 25, 25, 25]
    monitor = DeviceUsageMonitor(CPU, used_bytes=scripted(values), poll=False)
    monitor.reset()            # 10
    monitor.sample()           # 30
    monitor.start_window()     # 20
    monitor.sample()           # 50
    monitor.sample()           # 40
    assert monitor.end_window() == 70  # its own read (70) counts
    monitor.sample()           # 25: after the window, for the phase only
    assert monitor.peak_bytes() == 70 and monitor.end_window() == 0  # no window open: 0 (it still reads)
    assert values == []


def test_a_sample_read_across_a_reset_counts_for_neither_peak():
    monitor = DeviceUsageMonitor(CPU, used_bytes=lambda: 0, poll=False)
    values = [40, 200, 40]  # the reset reads 40; the sample read across it, 200; peak_bytes, 40
    monitor._used = scripted(values, during_next_read=lambda: monitor.reset())
    monitor.sample()
    assert monitor.peak_bytes() == 40


def test_a_sample_read_across_a_windows_start_counts_for_the_phase_only():
    monitor = DeviceUsageMonitor(CPU, used_bytes=lambda: 0, poll=False)
    values = [40, 200, 40, 40]  # the window's start reads 40; the sample read across it, 200; then 40, 40
    monitor._used = scripted(values, during_next_read=lambda: monitor.start_window())
    monitor.sample()
    assert monitor.end_window() == 40 and monitor.peak_bytes() == 200


def test_inert_on_a_cpu_rank():
    monitor = DeviceUsageMonitor(CPU)
    monitor.reset()
    monitor.start_window()
    monitor.sample()
    assert (monitor.end_window(), monitor.peak_bytes()) == (0, 0)


def test_allocator_counts_are_zero_on_a_cpu_rank():
    from flexrl_ds.parallel.device import allocator_counts

    assert allocator_counts(CPU) == {"alloc_retries": 0, "device_mallocs": 0}


def test_pinned_host_bytes_are_zero_on_a_cpu_rank():
    from flexrl_ds.parallel.device import pinned_host_bytes

    assert pinned_host_bytes(CPU) == {"current": 0, "peak": 0}
