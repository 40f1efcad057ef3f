"""runtime/gc_pauses.py against the collector itself: what `gc.collect` takes is what is counted."""

from __future__ import annotations

import gc
import time

import pytest

from flexrl_ds.runtime.gc_pauses import GCPauses


@pytest.fixture
def pauses():
    timer = GCPauses()
    yield timer
    timer.close()


def test_a_full_collection_is_timed_and_reset_starts_over(pauses):
    garbage = [[i] for i in range(200_000)]  # objects for the collector to walk
    del garbage
    pauses.reset()  # the young collections the allocations caused are not this test's
    started = time.perf_counter()
    gc.collect()  # a generation-2 collection
    wall = time.perf_counter() - started
    assert pauses.collections == 1 and 0 < pauses.seconds <= wall
    pauses.reset()
    assert (pauses.seconds, pauses.collections) == (0.0, 0)


def test_close_stops_the_timing(pauses):
    pauses.close()
    gc.collect()
    assert pauses.collections == 0
