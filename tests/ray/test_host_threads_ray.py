"""A policy rank in a Ray actor sets its host threads once, when it is built (runtime/host_threads.py),
and its later calls (where DeepSpeed's CPUAdam steps) compute with them; its place says how many
ranks share its node."""

from __future__ import annotations

import os
import sys

from flexrl_ds.runtime.host_threads import HostThreads, apply_host_threads
from flexrl_ds.runtime.worker_group import RayWorkerGroup

THREADS = 3


class ThreadsWorker:
    """What PolicyWorker does first, with an explicit count; `report` is a later call."""

    def __init__(self, place):
        self.ranks_on_node = place.ranks_on_node
        apply_host_threads(HostThreads(THREADS, "test"))

    def report(self) -> dict:
        import torch

        return {"threads": torch.get_num_threads(), "omp": os.environ["OMP_NUM_THREADS"],
                "ranks_on_node": self.ranks_on_node}


def test_a_ray_rank_keeps_its_host_threads_in_later_calls(ray_session):
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    group = RayWorkerGroup(ThreadsWorker, 2, num_cpus_per_rank=0.25, name="threads", timeout_s=60.0)
    try:
        reports = group.run(ThreadsWorker.report)
    finally:
        group.shutdown()
    assert reports == [{"threads": THREADS, "omp": str(THREADS), "ranks_on_node": 2}] * 2  # one node here
