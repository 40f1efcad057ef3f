"""parallel/profiling.py: a rank's profile names flexrl's regions with their calls and times, lists the
ops, and writes a trace that Perfetto reads (JSON with the regions' events)."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from flexrl_ds.parallel.profiling import RankProfiler, device_busy_seconds, region, region_table


def test_a_profile_names_the_regions_and_writes_a_trace(tmp_path):
    profiler = RankProfiler()
    profiler.start()
    a = torch.randn(64, 64)
    for _ in range(3):
        with region("forward"):
            b = a @ a
    with region("backward"):
        (b * 2).sum()
    written = profiler.stop(tmp_path / "profile" / "step_1_rank_0")
    assert written == str(tmp_path / "profile" / "step_1_rank_0.txt")
    text = (tmp_path / "profile" / "step_1_rank_0.txt").read_text()
    rows = {line.split()[0]: line.split()[1:] for line in text.splitlines() if line.startswith("flexrl/")}
    assert set(rows) == {"flexrl/forward", "flexrl/backward"}
    assert rows["flexrl/forward"][0] == "3" and rows["flexrl/backward"][0] == "1"  # calls
    assert float(rows["flexrl/forward"][1]) > 0  # CPU total ms
    assert "aten::mm" in text  # the ops table
    assert text.startswith("profiled ") and "s of wall time" in text.splitlines()[0]
    trace = json.loads(gzip.open(tmp_path / "profile" / "step_1_rank_0.json.gz").read())
    names = [event.get("name") for event in trace["traceEvents"]]
    assert names.count("flexrl/forward") == 3


def test_one_profile_at_a_time(tmp_path):
    profiler = RankProfiler()
    with pytest.raises(RuntimeError, match="no profile is running"):
        profiler.stop(tmp_path / "never")
    profiler.start()
    with pytest.raises(RuntimeError, match="already running"):
        profiler.start()
    profiler.stop(tmp_path / "first")
    profiler.start()  # a new one after the first ended
    profiler.stop(tmp_path / "second")
    assert (tmp_path / "second.txt").exists() and not (tmp_path / "never.txt").exists()


class _Event:
    def __init__(self, key, count, cpu_us, device_us, device_type=None, annotation=False, span=(0, 0)):
        from torch.autograd import DeviceType
        from torch.autograd.profiler_util import Interval

        self.key, self.count, self.cpu_time_total, self.device_time_total = key, count, cpu_us, device_us
        self.self_device_time_total = device_us
        self.device_type = device_type or DeviceType.CPU
        self.is_user_annotation = annotation
        self.time_range = Interval(*span)


def test_a_region_reported_on_the_cpu_and_on_the_device_is_one_row():
    from torch.autograd import DeviceType

    events = [_Event("flexrl/decoder", 3, 5_920_900, 1_393_700, annotation=True),  # CPU range, kernels inside
              _Event("flexrl/decoder", 3, 0, 5_929_400, DeviceType.CUDA, annotation=True),  # its span on the device
              _Event("flexrl/loss", 1, 4_100, 200, annotation=True),
              _Event("aten::mm", 10, 500, 0)]
    lines = region_table(events, device=True)
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in lines[1:]}
    assert rows == {"flexrl/decoder": [3, 5920.9, 1393.7, 5929.4], "flexrl/loss": [1, 4.1, 0.2, 0.0]}
    assert lines[1].startswith("flexrl/decoder")  # the longest on the device first
    assert [line.split()[:3] for line in region_table(events, device=False)[1:]] == [
        ["flexrl/decoder", "3", "5920.9"], ["flexrl/loss", "1", "4.1"]]


def test_device_busy_time_is_the_union_of_kernel_intervals():
    from torch.autograd import DeviceType

    cuda = DeviceType.CUDA
    events = [_Event("flexrl/decoder", 3, 0, 0, cuda, annotation=True, span=(0, 10_000_000)),  # a region: not work
              _Event("gemm", 1, 0, 0, cuda, span=(1_000_000, 2_000_000)),
              _Event("all_to_all", 1, 0, 0, cuda, span=(1_500_000, 2_500_000)),  # beside the gemm: counted once
              _Event("copy", 1, 0, 0, cuda, span=(3_000_000, 3_250_000)),
              _Event("inside", 1, 0, 0, cuda, span=(1_100_000, 1_200_000)),
              _Event("aten::mm", 1, 0, 0, span=(0, 9_000_000))]  # a CPU op
    assert device_busy_seconds(events) == pytest.approx(1.75)


def test_each_regions_calls_are_listed_in_order_with_their_own_times(tmp_path):
    """The slow call of a region stands out in place: here the second of three, which sleeps."""
    import time

    profiler = RankProfiler()
    profiler.start()
    for pause in (0.0, 0.3, 0.0):  # 0.3 s: longer than a loaded machine's pause of the other two
        with region("vision_tower"):
            time.sleep(pause)
    text = open(profiler.stop(tmp_path / "p")).read()
    line = next(line for line in text.splitlines() if line.startswith("  flexrl/vision_tower: "))
    first, second, third = (float(ms) for ms in line.split(": ")[1].split(", "))
    assert second >= 300 > max(first, third)
