"""`ProcessWorkerGroup` (runtime/process_workers.py): the worker-group interface on local processes,
and failures that name the rank instead of hanging."""

from __future__ import annotations

import os
import socket

import pytest

from flexrl_ds.runtime.process_workers import ProcessWorkerGroup

pytestmark = pytest.mark.timeout(120)


class EchoWorker:
    def __init__(self, place, offset: int = 0, fail_on_rank: int | None = None):
        if place.rank == fail_on_rank:
            raise ValueError(f"rank {place.rank} refuses to start")
        self.place, self.offset = place, offset

    def where(self, extra: int = 0):
        return self.place.rank, self.place.world_size, self.place.master_port, self.offset + extra

    def add(self, value: int) -> int:
        return self.place.rank + value

    def fail_on(self, rank: int) -> int:
        if self.place.rank == rank:
            raise RuntimeError("boom")
        return self.place.rank

    def exit_on(self, rank: int) -> int:
        if self.place.rank == rank:
            os._exit(3)
        return self.place.rank


class GroupWorker:
    """Joins the group's process group the way the trainer's workers do."""

    def __init__(self, place):
        from flexrl_ds.runtime.worker_group import join_process_group

        self.place = place
        join_process_group(place, "gloo", timeout_s=60)

    def rank_sum(self) -> tuple[int, int]:
        """(sum of the ranks over the group, the rendezvous port)"""
        import torch
        import torch.distributed as dist

        total = torch.tensor([self.place.rank])
        dist.all_reduce(total)
        return int(total.item()), self.place.master_port


def test_ranks_join_one_process_group_through_the_store_the_group_holds():
    with ProcessWorkerGroup(GroupWorker, 3, name="pg", timeout_s=60) as group:
        answers = group.run(GroupWorker.rank_sum)
        assert [total for total, _ in answers] == [sum(range(3))] * 3
        (port,) = {port for _, port in answers}
        # The rendezvous port stays bound by the group's store: no other process can take it.
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))


def test_run_and_run_each_return_results_in_rank_order():
    with ProcessWorkerGroup(EchoWorker, 3, {"offset": 10}, name="echo", timeout_s=60) as group:
        places = group.run(EchoWorker.where, extra=1)
        assert [p[:2] for p in places] == [(0, 3), (1, 3), (2, 3)]
        assert len({p[2] for p in places}) == 1 and {p[3] for p in places} == {11}  # one rendezvous
        assert group.run_each(EchoWorker.add, [(100,), (200,), (300,)]) == [100, 201, 302]


def test_a_failing_rank_is_named_and_stops_the_group():
    with ProcessWorkerGroup(EchoWorker, 2, name="echo", timeout_s=60) as group:
        with pytest.raises(RuntimeError, match=r"echo.fail_on failed on rank 1 \(fail_on\):(.|\n)*boom"):
            group.run(EchoWorker.fail_on, 1)
        with pytest.raises(RuntimeError, match="stopped"):
            group.run(EchoWorker.add, 1)


def test_constructor_failure_and_dead_process_are_named():
    with ProcessWorkerGroup(EchoWorker, 2, {"fail_on_rank": 0}, name="echo", timeout_s=60) as group:
        with pytest.raises(RuntimeError, match=r"rank 0 \(building its worker\)(.|\n)*refuses to start"):
            group.run(EchoWorker.add, 1)
    with ProcessWorkerGroup(EchoWorker, 2, name="echo", timeout_s=60) as group:
        with pytest.raises(RuntimeError, match="rank 1: its process exited with code 3"):
            group.run(EchoWorker.exit_on, 1)


def test_at_least_one_rank():
    with pytest.raises(ValueError, match="at least one rank"):
        ProcessWorkerGroup(EchoWorker, 0)


def test_a_method_is_given_as_itself_and_must_be_the_workers():
    """`run(EchoWorker.add, ...)`, never `run("add", ...)`; a method of another class is refused before
    any rank is asked, and the group keeps working."""
    with ProcessWorkerGroup(EchoWorker, 2, name="echo", timeout_s=60) as group:
        with pytest.raises(TypeError, match="method itself"):
            group.run("add", 1)
        with pytest.raises(TypeError, match="GroupWorker.rank_sum is not a method of the group's worker class "
                                            "EchoWorker"):
            group.run_each(GroupWorker.rank_sum, [(), ()])
        assert group.run(EchoWorker.add, 1) == [1, 2]
