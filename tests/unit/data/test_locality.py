"""Node-aware routing (pure rule, its wiring through the loader) and the cross-node byte count."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexrl_ds.loader.actors import SliceMaker
from flexrl_ds.loader.config import LoaderConfig, PoolConfig
from flexrl_ds.loader.destinations import RankDealing
from flexrl_ds.loader.materializer import Materializer
from flexrl_ds.loader.metastore import PromptKey, SampleId
from flexrl_ds.loader.proxy_loader import ProxyLoader, requests_for_samples
from flexrl_ds.loader.routing import LoadTracker, least_loaded, route_near

from test_loader_unit import FakeFetcher, FakePreprocessor, _records

NODES = ("n0", "n1", "n2")


@st.composite
def _cluster(draw):
    """(loads, actor -> node, destinations, cost, slack)."""
    num = draw(st.integers(1, 6))
    names = [f"a{i}" for i in range(num)]
    loads = {name: draw(st.floats(0, 100)) for name in names}
    nodes = {name: draw(st.sampled_from(NODES)) for name in names}
    destinations = draw(st.dictionaries(st.sampled_from(NODES), st.floats(0.5, 4), max_size=3))
    return loads, nodes, destinations, draw(st.floats(0, 50)), draw(st.floats(0, 3))


def test_route_near_examples():
    loads, nodes = {"a": 0.0, "b": 5.0, "c": 12.0}, {"a": "n0", "b": "n1", "c": "n1"}
    assert route_near(loads, nodes, {"n1": 1}, cost=10, slack=1.0) == "b"  # 5 <= 0 + 10
    assert route_near(loads, nodes, {"n1": 1}, cost=10, slack=0.4) == "a"  # 5 > 0 + 4: least-loaded
    assert route_near(loads, nodes, {"n1": 1}, cost=10, slack=0.0) == "a"
    assert route_near(loads, nodes, {}, cost=10, slack=1.0) == "a"
    assert route_near(loads, nodes, {"n2": 1}, cost=10, slack=9.0) == "a"  # no actor on n2
    # heavier node first, then lighter load
    assert route_near(loads, nodes, {"n0": 1, "n1": 2}, cost=10, slack=2.0) == "b"
    assert route_near(loads, nodes, {"n0": 1, "n1": 2}, cost=10, slack=2.0, alive=["a", "c"]) == "c"
    with pytest.raises(ValueError, match="non-negative"):
        route_near(loads, nodes, {"n1": 1}, cost=10, slack=-1)


@given(_cluster())
def test_route_near_takes_the_heaviest_near_actor_within_slack_else_least_loaded(case):
    loads, nodes, destinations, cost, slack = case
    chosen = route_near(loads, nodes, destinations, cost, slack)
    floor = min(loads.values())
    within = [n for n in loads if destinations.get(nodes[n], 0) > 0 and loads[n] <= floor + slack * cost]
    if not within:
        assert chosen == least_loaded(loads)
        return
    assert chosen in within
    best_weight = max(destinations[nodes[n]] for n in within)
    assert destinations[nodes[chosen]] == best_weight
    assert loads[chosen] == min(loads[n] for n in within if destinations[nodes[n]] == best_weight)


@given(st.lists(st.tuples(st.floats(0, 100), st.sampled_from(NODES)), max_size=40),
       st.integers(1, 6), st.floats(0, 3), st.data())
def test_node_aware_loads_stay_within_slack_plus_one_task(tasks, num_actors, slack, data):
    names = [f"a{i}" for i in range(num_actors)]
    nodes = {name: data.draw(st.sampled_from(NODES)) for name in names}
    tracker = LoadTracker(names, nodes, locality_slack=slack)
    for cost, node in tasks:
        tracker.assign(cost, {node: 1.0})
    if tasks:
        spread = max(tracker.load(n) for n in names) - min(tracker.load(n) for n in names)
        assert spread <= (slack + 1) * max(cost for cost, _ in tasks) + 1e-6


@given(st.lists(st.floats(0, 100), min_size=1, max_size=30), st.data())
def test_unbounded_slack_always_decodes_on_a_consumer_node(costs, data):
    nodes = {"a0": "n0", "a1": "n1", "a2": "n1"}
    tracker = LoadTracker(nodes, nodes, locality_slack=math.inf)
    for cost in costs:
        node = data.draw(st.sampled_from(("n0", "n1")))
        assert nodes[tracker.assign(cost, {node: 1.0})] == node


def test_locality_slack_is_validated():
    with pytest.raises(ValueError, match="locality_slack"):
        PoolConfig(locality_slack=-0.5)
    with pytest.raises(ValueError, match="locality_slack"):
        LoadTracker(["a"], locality_slack=-1)


@given(st.integers(1, 5), st.integers(1, 4), st.integers(0, 20))
def test_rank_dealing_splits_samples_and_names_their_nodes(num_ranks, n, slot):
    dealing = RankDealing(tuple(f"node{r % 2}" for r in range(num_ranks)), n)
    samples = [SampleId(3, slot, k) for k in range(n)]
    shares = dealing.shares(samples)
    assert sorted(s for share in shares for s in share) == samples
    expected: dict[str, float] = {}
    for rank, share in enumerate(shares):
        if share:
            expected[dealing.rank_nodes[rank]] = expected.get(dealing.rank_nodes[rank], 0) + len(share)
    assert dealing(PromptKey(3, slot)) == expected


class NodePool:
    """Synchronous pool with real `LoadTracker` routing: actor a on n0, b on n1."""

    lost_errors = ()

    def __init__(self, slack=math.inf):
        self.maker, self.objects, self.submitted = SliceMaker(FakePreprocessor), {}, []
        self.actor_nodes = {"a": "n0", "b": "n1"}
        self.tracker = LoadTracker(self.actor_nodes, self.actor_nodes, locality_slack=slack)
        self.config = PoolConfig(timeout_s=10)
        self.alive = ["a", "b"]

    def probe(self, records):
        return self.maker.probe(records)

    def task_result(self, ref):
        return self.objects[ref]

    def submit(self, key, meta, layouts, cost, destinations=None):
        owner = self.tracker.assign(cost, destinations)
        refs = {}
        for slice_key, value in self.maker.make_slices(key, meta, layouts).items():
            refs[slice_key] = ref = f"obj:{owner}:{key}:{slice_key.item_index}:{slice_key.chunk_index}"
            self.objects[ref] = value
        self.objects[task := f"task:{owner}:{key}"] = refs
        self.submitted.append((key, owner, destinations))
        return owner, task

    def release(self, released):
        pass


def _pull(loader, pool, dealing, fetch_nodes):
    """Run one step: every rank pulls its share; returns [(bytes, cross-node bytes)] per rank."""
    step = loader.next_step()
    out = []
    for rank, share in enumerate(dealing.shares(step.sample_ids())):
        fetcher = FakeFetcher(pool.objects)
        fetcher.node_id = fetch_nodes[rank]
        worker = Materializer(fetcher)
        worker.prefetch(loader.assignment(step, requests_for_samples(step, share), fetch_nodes[rank]))
        got = worker.get(step.step)
        worker.close()
        out.append((got.bytes_fetched, got.bytes_cross_node))
    return step, out


def test_loader_routes_to_the_dealt_node_and_materializers_count_cross_node_bytes():
    dealing = RankDealing(("n0", "n1"), 1)
    config = LoaderConfig(global_batch=4, lookahead_steps=0, shuffle=False)
    pool = NodePool()
    loader = ProxyLoader(_records(8), pool, config, destinations=dealing)
    step, out = _pull(loader, pool, dealing, ("n0", "n1"))
    assert [(key.slot, owner) for key, owner, _ in pool.submitted] == [(0, "a"), (1, "b"), (2, "a"), (3, "b")]
    assert all(total > 0 and cross == 0 for total, cross in out)
    # without destinations and before any consumer asked: least-loaded, and the count sees crossings
    plain_pool = NodePool()
    plain = ProxyLoader(_records(8), plain_pool, config)
    _, plain_out = _pull(plain, plain_pool, dealing, ("n0", "n1"))
    owners = {key.slot: owner for key, owner, _ in plain_pool.submitted}
    nodes_of_rank = {0: "a", 1: "b"}
    crossing = [slot for slot, owner in owners.items() if owner != nodes_of_rank[slot % 2]]
    assert all(where is None for _, _, where in plain_pool.submitted)
    assert (sum(cross for _, cross in plain_out) > 0) == bool(crossing)
    assert sum(total for total, _ in plain_out) == sum(total for total, _ in out)  # same pixels either way
    # step 2: the plain loader has learned that n0 and n1 consume (by rows asked for)
    assert set(plain.consumer_rows) == {"n0", "n1"}
    asked = dict(plain.consumer_rows)
    plain.next_step()
    assert len(plain_pool.submitted) == 8 and all(where == asked for _, _, where in plain_pool.submitted[4:])


def test_a_worker_on_an_unknown_node_counts_nothing_as_crossing():
    dealing = RankDealing(("n0",), 1)
    pool = NodePool()
    loader = ProxyLoader(_records(4), pool, LoaderConfig(global_batch=2, lookahead_steps=0, shuffle=False))
    _, out = _pull(loader, pool, dealing, ("",))
    assert out[0][0] > 0 and out[0][1] == 0
