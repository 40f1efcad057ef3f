"""Routing and slicing rules of ShadowLoader (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexrl_ds.loader.routing import LoadTracker, chunk_ranges, chunks_covering, least_loaded, route_greedy


def test_least_loaded_picks_smallest_load_and_breaks_ties_by_name():
    assert least_loaded({"b": 3.0, "a": 5.0, "c": 1.0}) == "c"
    assert least_loaded({"b": 2.0, "a": 2.0}) == "a"
    assert least_loaded({"b": 2.0, "a": 1.0}, alive=["b"]) == "b"
    with pytest.raises(ValueError, match="no live"):
        least_loaded({}, alive=[])


@given(st.lists(st.floats(0, 1000), max_size=40), st.integers(1, 6))
def test_greedy_routing_keeps_loads_within_one_task(costs, num_actors):
    names = [f"actor-{i}" for i in range(num_actors)]
    chosen = route_greedy(costs, {name: 0.0 for name in names})
    loads = {name: 0.0 for name in names}
    for cost, name in zip(costs, chosen):
        # the chosen actor had the smallest load at the time (independent check)
        assert loads[name] == min(loads.values())
        loads[name] += cost
    if costs:
        assert max(loads.values()) - min(loads.values()) <= max(costs) + 1e-6


def test_load_tracker_credits_finished_work_and_skips_dead_actors():
    tracker = LoadTracker(["a", "b"])
    assert tracker.assign(10) == "a"
    assert tracker.assign(3) == "b"
    assert tracker.assign(3) == "b"  # b has 3 < 10
    tracker.finish("a", 10)
    assert tracker.assign(1) == "a"
    tracker.mark_dead("a")
    assert tracker.alive == ["b"] and tracker.dead == ["a"]
    assert tracker.assign(100) == "b"
    tracker.finish("a", 5)  # late completion of a dead actor's task is ignored
    tracker.mark_dead("b")
    with pytest.raises(ValueError, match="no live"):
        tracker.assign(1)


@given(st.integers(1, 200), st.integers(1, 50))
def test_chunks_partition_the_groups(num_groups, per_chunk):
    ranges = chunk_ranges(num_groups, per_chunk)
    assert ranges[0][0] == 0 and ranges[-1][1] == num_groups
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(0 < hi - lo <= per_chunk for lo, hi in ranges)


@given(st.integers(1, 100), st.integers(1, 20), st.data())
def test_chunks_covering_is_exactly_the_overlapping_chunks(num_groups, per_chunk, data):
    ranges = chunk_ranges(num_groups, per_chunk)
    start = data.draw(st.integers(0, num_groups - 1))
    end = data.draw(st.integers(start + 1, num_groups))
    covering = chunks_covering(ranges, start, end)
    groups = {g for i in covering for g in range(*ranges[i])}
    assert set(range(start, end)) <= groups
    # every chosen chunk is needed
    assert all(set(range(*ranges[i])) & set(range(start, end)) for i in covering)


def test_bad_ranges_are_rejected():
    with pytest.raises(ValueError, match="at least one temporal group"):
        chunk_ranges(0, 2)
    with pytest.raises(ValueError, match="groups_per_chunk"):
        chunk_ranges(4, 0)
    with pytest.raises(ValueError, match="outside"):
        chunks_covering(chunk_ranges(4, 2), 3, 5)
