"""A rank of a gloo group killed, or stalled inside a collective: the survivors fail within the
group's collective timeout, and the driver's call says which rank was lost and what each survivor
saw (runtime/rank_failures.py); with the step and the checkpoint once the driver adds them."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from flexrl_ds.runtime.rank_failures import GRACE_S, LostRanks
from flexrl_ds.runtime.worker_group import RayWorkerGroup, join_process_group

pytestmark = [pytest.mark.ray]
COLLECTIVE_TIMEOUT_S = 4.0


class GlooWorker:
    def __init__(self, place):
        self.rank = place.rank
        join_process_group(place, "gloo", COLLECTIVE_TIMEOUT_S)

    def pid(self) -> int:
        return os.getpid()

    def all_reduce(self, fault_rank: int = -1, fault: str = "") -> float:
        if self.rank == fault_rank and fault == "die":
            os._exit(3)
        if self.rank == fault_rank and fault == "stall":
            time.sleep(600)  # sleeps where the others wait for it in the collective
        value = torch.ones(4)
        dist.all_reduce(value)
        return float(value[0])


@pytest.fixture
def group(ray_session):
    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    group = RayWorkerGroup(GlooWorker, 3, num_cpus_per_rank=0.25, name="policy", timeout_s=120.0,
                           collective_timeout_s=COLLECTIVE_TIMEOUT_S)
    yield group
    group.shutdown()


@pytest.mark.parametrize("fault", ["die", "stall"])
def test_every_survivor_fails_within_the_timeout_naming_the_lost_rank(group, fault):
    assert group.run(GlooWorker.all_reduce) == [3.0, 3.0, 3.0]
    started = time.monotonic()
    with pytest.raises(LostRanks) as raised:
        group.run(GlooWorker.all_reduce, 1, fault)
    elapsed = time.monotonic() - started
    lost = raised.value
    pid = group.pids[1]
    assert list(lost.lost) == [1] and lost.lost[1].startswith(f"(pid {pid}) " + ("died" if fault == "die" else "stalled"))
    assert sorted(lost.survivors) == [0, 2]
    # the survivors fail at the collective timeout; the silent rank gets that timeout and GRACE_S more
    # to answer before it is named; then the group asks every rank for its lines (5 s each, at most)
    assert lost.waited_s < COLLECTIVE_TIMEOUT_S + 5 and elapsed < lost.waited_s + COLLECTIVE_TIMEOUT_S + GRACE_S + 15
    said = str(lost.at(6, "OUT/checkpoints/step_4"))
    survivor_lines = [line for line in said.splitlines() if "(survivor)" in line]
    assert len(survivor_lines) == 2
    assert all("after losing rank 1" in line and "at step 7 (0-based 6)" in line for line in survivor_lines)
    assert said.splitlines()[0].startswith("policy.all_reduce at step 7 (0-based 6): lost rank 1: rank 1 ")
    assert "--resume, from OUT/checkpoints/step_4" in said
