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


class OutOfMemoryWorker:
    """A policy rank whose update phase runs out of device memory (torch's error type, injected)."""

    def __init__(self, place):
        from flexrl_ds.parallel import device as device_mod

        self.rank = place.rank
        self.device_info = device_mod.CPU
        self.device_usage = device_mod.DeviceUsageMonitor(device_mod.CPU, used_bytes=lambda: 12 * 2**30, poll=False)

    def train(self, job):
        from flexrl_ds.trainer.policy_worker import PolicyWorker

        return PolicyWorker.train(self, job)  # the phase method itself, its first step failing

    def _batches(self, job):
        import torch

        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB")


def test_a_device_oom_in_a_phase_reaches_the_driver_as_one_line(ray_session):
    from flexrl_ds.trainer.device_oom import DeviceOutOfMemory

    ray = ray_session
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    group = RayWorkerGroup(OutOfMemoryWorker, 1, num_cpus_per_rank=0.25, name="policy", timeout_s=60.0)
    try:
        with pytest.raises(DeviceOutOfMemory) as raised:
            group.run(OutOfMemoryWorker.train, None)
        said = str(raised.value)
        # as the rank raised it, not Ray's wrapper (whose text is the remote traceback): a ValueError,
        # which `flexrl` prints as one line (cli/main.py)
        assert len(said.splitlines()) == 1 and not isinstance(raised.value, ray.exceptions.RayTaskError)
        assert said.startswith("rank 0: out of device memory in the update phase (peak 12.0 GiB in use")
        assert "flexrl.trainer.activation_checkpointing" in said and "Tried to allocate 2.50 GiB" in said
    finally:
        group.shutdown()
