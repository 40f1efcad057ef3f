"""Slices shipped as numpy (zero-copy from Ray's object store) and the loader bench's phase split.

No Ray: the object store's read-only views are stood in for by read-only numpy arrays.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flexrl_ds.bench.loader_bench import EXPOSED_PHASES, LoaderBenchConfig, add_decode_timings, step_phases
from flexrl_ds.loader.actors import shippable_slice
from flexrl_ds.loader.materializer import SliceRequest, cut_request
from flexrl_ds.loader.metastore import PromptKey, SliceKey, make_layout


def _store_views(key, layout, full_TD):
    """What a worker's `ray.get` yields for every chunk: read-only numpy views."""
    rows = layout.rows_per_group
    slices = {}
    for index, (start, stop) in enumerate(layout.chunks):
        shipped = shippable_slice({"pixel_values": full_TD[start * rows : stop * rows].clone(),
                                   "grid_thw": (stop - start, *layout.grid_thw[1:])})
        assert isinstance(shipped["pixel_values"], np.ndarray)
        shipped["pixel_values"].setflags(write=False)
        slices[SliceKey(key, 0, index)] = shipped
    return slices


@pytest.mark.parametrize("t_start, t_stop", [(0, None), (1, 4), (4, 5), (2, 3), (0, 2)])
def test_cut_from_read_only_numpy_gives_exact_writable_tensors(t_start, t_stop):
    key = PromptKey(0, 0)
    layout = make_layout(0, "video", (5, 2, 3), groups_per_chunk=2)  # chunks (0,2) (2,4) (4,5), 6 rows/group
    full_TD = torch.randn(30, 12)
    slices = _store_views(key, layout, full_TD)
    out = cut_request(layout, SliceRequest(key, 0, t_start, t_stop), slices)
    stop = 5 if t_stop is None else t_stop
    pixels = out["pixel_values"]
    assert isinstance(pixels, torch.Tensor) and torch.equal(pixels, full_TD[t_start * 6 : stop * 6])
    assert out["grid_thw"] == (stop - t_start, 2, 3)
    assert pixels.numpy().flags.writeable  # owned by the worker: the store's object can be freed
    for value in slices.values():
        assert not np.shares_memory(pixels.numpy(), value["pixel_values"])


def test_step_phases_sum_to_the_exposed_time_along_the_last_worker():
    compute_ms = 1000.0
    stamps = (100.0, 100.010, 100.015, 101.200)  # begin, next_step back, prefetches sent, results back
    early = {"entered_at": 100.020, "data_ready_at": 100.021, "compute_end_at": 101.021, "ready_at": 99.0,
             "task_wait_s": 0.0, "pull_s": 0.01, "cut_s": 0.5}
    late = {"entered_at": 100.115, "data_ready_at": 100.120, "compute_end_at": 101.150, "ready_at": 100.118,
            "task_wait_s": 0.2, "pull_s": 0.02, "cut_s": 0.1}
    wall_s = 1.210
    phases = step_phases(compute_ms, stamps, [early, late], wall_s)
    assert phases["exposed"] == pytest.approx(210.0)
    assert sum(phases[name] for name in EXPOSED_PHASES) == pytest.approx(phases["exposed"])
    assert phases["call"] == pytest.approx(100.0) and phases["wait"] == pytest.approx(5.0)
    assert phases["overrun"] == pytest.approx(30.0) and phases["return"] == pytest.approx(50.0)
    assert phases["ready_margin"] == pytest.approx(-3.0)  # the late worker's data came 3 ms after entry
    assert phases["pull"] == pytest.approx(20.0) and phases["cut"] == pytest.approx(500.0)


def test_bench_modes_are_checked(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("")
    with pytest.raises(ValueError, match="--modes"):
        LoaderBenchConfig(data=str(data), global_batches=[2], steps=1, actors=[1], modes=["fast"])
    assert LoaderBenchConfig(data=str(data), global_batches=[2], steps=1, actors=[1]).modes == ["none", "central",
                                                                                                 "shadow"]


def test_decode_timings_say_how_late_the_next_steps_decodes_finished():
    phases = [{"exposed": 10.0}, {"exposed": 5000.0}, {"exposed": 8.0}]
    asked = [(2, 100.0), (3, 120.0), (4, 140.0)]  # iteration i asks for step i+2 at asked_at
    log = {PromptKey(2, 0): (90.0, 95.0), PromptKey(2, 1): (95.0, 99.0), PromptKey(3, 0): (118.0, 125.0)}
    add_decode_timings(phases, asked, log)
    assert phases[0]["decode_late"] == pytest.approx(-1000.0) and phases[0]["decode_busy"] == pytest.approx(9000.0)
    assert phases[1]["decode_late"] == pytest.approx(5000.0)  # the loop waited 5 s for step 3's decode
    assert "decode_late" not in phases[2]
