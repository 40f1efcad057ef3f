"""Run by tests/ray/test_locality_cluster.py in a process of its own: a 2-node Ray cluster on this
machine (`ray.cluster_utils.Cluster`, nodes told apart by custom resources `node_a` / `node_b`),
2 preprocessing actors per node, one consumer (a Materializer) per node. Each routing mode runs
2 steps of 4 prompts, dealt to the consumers by `RankDealing` (slot parity), and reports, per
mode: bytes pulled, bytes the Materializers counted as cross-node, the cross-node bytes expected
from where each prompt's owner actor says it runs, and whether every tensor equals a
single-process reference decode. Prints one line `RESULT <json>`.

    python tests/ray/locality_cluster.py WORK_DIR

Modes: `plain` (no destinations, and the consumers do not name their node: least-loaded only),
`near_inf` (node-aware, slack inf: always on the consumer's node), `near_default` (node-aware,
the default `flexrl.data.pool.locality_slack`).
"""

from __future__ import annotations

import functools
import json
import math
import socket
import sys
from pathlib import Path

import numpy as np
import ray
from ray.cluster_utils import Cluster

from flexrl_ds.bench.loader_media import MediaDatasetSpec, write_media_dataset
from flexrl_ds.loader.actors import PreprocessPool
from flexrl_ds.loader.config import LoaderConfig, PoolConfig
from flexrl_ds.loader.destinations import RankDealing
from flexrl_ds.loader.proxy_loader import ProxyLoader, requests_for_samples
from flexrl_ds.media.config import MediaConfig
from flexrl_ds.media.preprocess import SamplePreprocessor
from flexrl_ds.media.records import read_dataset

DATA_CONFIG = MediaConfig(video_min_pixels=28 * 28 * 4, video_max_pixels=28 * 28 * 16, video_fps=4.0)
NODE_MB = 100 * 2**20


@ray.remote(num_cpus=0.05)
class Consumer:
    """A training rank's pixel pull: one Materializer, pinned to a node by a custom resource."""

    def __init__(self):
        from flexrl_ds.loader.materializer import Materializer, RayFetcher

        self.materializer = Materializer(RayFetcher(timeout_s=120))

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pull(self, assignment) -> dict:
        self.materializer.prefetch(assignment)
        out = self.materializer.get(assignment.step)
        return {"bytes": out.bytes_fetched, "cross": out.bytes_cross_node, "requests": list(out.requests),
                "pixels": [t["pixel_values"].numpy() for t in out.tensors]}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _reference(metas, cache, request) -> np.ndarray:
    """Rows of `request` from a decode in this process (whole-item requests here)."""
    if request.prompt not in cache:
        meta = metas[request.prompt]
        cache[request.prompt] = {i: t.pixel_values.numpy() for i, t in
                                 SamplePreprocessor(DATA_CONFIG).materialize(meta).items()}
    return cache[request.prompt][request.item_index]


def run_mode(pool, records, dealing, consumers, consumer_nodes, actor_nodes, mode) -> dict:
    destinations = None if mode == "plain" else dealing
    loader = ProxyLoader(records, pool, LoaderConfig(global_batch=4, seed=0, groups_per_chunk=2),
                         destinations=destinations)
    totals = {"bytes": 0, "cross": 0, "expected_cross": 0, "num_tensors": 0, "num_equal": 0, "owners": []}
    for _ in range(2):
        step = loader.next_step()
        metas, cache = {p.key: p.meta for p in step.prompts}, {}
        owners = {p.key: loader.store.entry(p.key).owner for p in step.prompts}
        totals["owners"].append({str(key): actor_nodes[owner][:8] for key, owner in owners.items()})
        shares = dealing.shares(step.sample_ids())
        assignments = [loader.assignment(step, requests_for_samples(step, share)) for share in shares]
        outs = ray.get([c.pull.remote(a) for c, a in zip(consumers, assignments)], timeout=300)
        for rank, out in enumerate(outs):
            totals["bytes"] += out["bytes"]
            totals["cross"] += out["cross"]
            for request, pixels in zip(out["requests"], out["pixels"]):
                reference = _reference(metas, cache, request)
                totals["num_tensors"] += 1
                totals["num_equal"] += int(reference.shape == pixels.shape and np.array_equal(reference, pixels))
                if actor_nodes[owners[request.prompt]] != consumer_nodes[rank]:
                    totals["expected_cross"] += reference.nbytes
        loader.release(step)
    loader.close()
    return totals


def main(work_dir: str) -> None:
    node_args = {"num_cpus": 1, "object_store_memory": NODE_MB, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "gcs_server_port": _free_port(),
                                                            "resources": {"node_a": 1}})
    try:
        cluster.add_node(**node_args, resources={"node_b": 1})
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        path = write_media_dataset(Path(work_dir), MediaDatasetSpec(num_videos=4, num_images=4, video_seconds=2.0))
        records = read_dataset(path)
        consumers = [Consumer.options(resources={name: 0.1}).remote() for name in ("node_a", "node_b")]
        consumer_nodes = ray.get([c.node_id.remote() for c in consumers], timeout=120)
        pool = PreprocessPool(functools.partial(SamplePreprocessor, DATA_CONFIG),
                              PoolConfig(num_actors_per_node=2, num_cpus_per_actor=0.2, timeout_s=120))
        reported = {stats["name"]: stats["node_id"] for stats in pool.stats()}  # where each actor says it runs
        dealing = RankDealing(tuple(consumer_nodes), 1)
        result = {"num_nodes": len({n["NodeID"] for n in ray.nodes() if n["Alive"]}),
                  "consumer_nodes_differ": consumer_nodes[0] != consumer_nodes[1],
                  "pool_nodes_match_actors": reported == pool.actor_nodes,
                  "actors_per_node": sorted(list(reported.values()).count(n) for n in set(reported.values()))}
        default_slack = pool.tracker.locality_slack
        for mode, slack in (("plain", default_slack), ("near_inf", math.inf), ("near_default", default_slack)):
            pool.tracker.locality_slack = slack
            result[mode] = run_mode(pool, records, dealing, consumers, consumer_nodes, reported, mode)
        pool.shutdown()
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
