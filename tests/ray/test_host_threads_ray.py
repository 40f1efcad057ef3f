"""A Ray actor reserving one CPU starts on one host thread (Ray sets OMP_NUM_THREADS=1); a policy
rank's place says how many ranks share its node, and the rank takes the node's cores over them
(runtime/host_threads.py), so DeepSpeed's CPUAdam and ZeRO-3's host-side copies use them."""

from __future__ import annotations

import sys

from flexrl_ds.runtime.host_threads import apply_host_threads, automatic_host_threads, usable_cores
from flexrl_ds.runtime.worker_group import RayWorkerGroup


class ThreadsWorker:
    """What PolicyWorker does first, with the counts before and after."""

    def __init__(self, place):
        import os

        import torch

        self.before = (os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads())
        self.ranks_on_node, self.cores = place.ranks_on_node, usable_cores()
        apply_host_threads(automatic_host_threads(self.cores, place.ranks_on_node))
        self.after = (os.environ["OMP_NUM_THREADS"], torch.get_num_threads())

    def report(self) -> dict:
        return {"before": self.before, "after": self.after, "ranks_on_node": self.ranks_on_node, "cores": self.cores}


def test_a_ray_rank_computes_on_its_share_of_the_nodes_cores(ray_session):
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    group = RayWorkerGroup(ThreadsWorker, 2, num_cpus_per_rank=0.25, name="threads", timeout_s=60.0)
    try:
        reports = group.run(ThreadsWorker.report)
    finally:
        group.shutdown()
    for report in reports:
        assert report["before"] == ("1", 1)  # Ray's default for an actor: one thread
        assert report["ranks_on_node"] == 2  # both ranks on this one node
        share = max(1, report["cores"] // 2)
        assert report["after"] == (str(share), share)
