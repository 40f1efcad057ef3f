"""parallel/profiling.py: a rank's profile names flexrl's regions with their calls and times, lists the
ops, and writes a trace that Perfetto reads (JSON with the regions' events)."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from flexrl_ds.parallel.profiling import RankProfiler, region


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
