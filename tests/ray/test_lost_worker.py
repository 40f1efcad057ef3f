"""A policy-group rank that dies under Ray: the driver's call fails at once with one line naming the
group, the call and that a worker died (runtime/lost_workers.py), Ray's report kept as its cause."""

from __future__ import annotations

import os
import sys

import pytest

from flexrl_ds.runtime.worker_group import RayWorkerGroup


class DyingWorker:
    """A worker whose `die` ends its process as a crash would (no Python exception to report)."""

    def __init__(self, place):
        self.rank = place.rank

    def ping(self) -> int:
        return self.rank

    def die(self) -> None:
        os._exit(3)


def test_a_rank_that_dies_is_said_in_one_line(ray_session):
    ray = ray_session
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import this test module
    group = RayWorkerGroup(DyingWorker, 2, num_cpus_per_rank=0.25, name="policy", timeout_s=60.0,
                           memory_hint="never said: this is no memory kill")
    try:
        assert group.run(DyingWorker.ping) == [0, 1]
        with pytest.raises(RuntimeError, match=r"^policy\.die: a worker died \(") as raised:
            group.run(DyingWorker.die)
        assert isinstance(raised.value.__cause__, ray.exceptions.RayActorError)  # Ray's report kept
        said = str(raised.value)  # no memory kill: neither said so nor the memory hint given
        assert "memory monitor" not in said and "never said" not in said and len(said.splitlines()) == 1
    finally:
        group.shutdown()
