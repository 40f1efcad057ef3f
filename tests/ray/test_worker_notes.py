"""What a worker says in a Ray actor reaches the driver's console (common/notes.py): Ray does not
forward the actors' output (log_to_driver off), so a worker group prints the lines its ranks said
after each call, a line said alike by several ranks once, also when the call failed."""

from __future__ import annotations

import sys

import pytest

from flexrl_ds.common import notes
from flexrl_ds.runtime.worker_group import RayWorkerGroup


class SayingWorker:
    def __init__(self, place):
        self.rank = place.rank
        notes.say(f"rank {self.rank}: built")

    def greet(self) -> int:
        notes.say("every rank: hello")
        notes.say(f"rank {self.rank}: hello")
        print(f"rank {self.rank}: printed, not said")  # stays in the actor's log file
        return self.rank

    def fail(self) -> None:
        notes.say(f"rank {self.rank}: about to fail")
        raise ValueError("on purpose")

    def fail_on_rank_1(self) -> int:
        notes.say(f"rank {self.rank}: started")
        if self.rank == 1:
            raise ValueError("rank 1 on purpose")
        return self.rank


def test_the_ranks_lines_are_printed_by_the_driver(ray_session, capsys):
    ray = ray_session
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import this test module
    group = RayWorkerGroup(SayingWorker, 2, num_cpus_per_rank=0.25, name="sayers", timeout_s=60.0)
    try:
        assert capsys.readouterr().out.splitlines() == ["rank 0: built", "rank 1: built"]
        assert group.run(SayingWorker.greet) == [0, 1]
        assert capsys.readouterr().out.splitlines() == ["every rank: hello", "rank 0: hello", "rank 1: hello"]
        assert group.run(SayingWorker.greet) == [0, 1]  # said again: printed again, nothing left from before
        assert capsys.readouterr().out.count("every rank: hello") == 1
        assert group.run_each(SayingWorker.greet, [(), ()]) == [0, 1]  # the lines come back with the results
        assert capsys.readouterr().out.splitlines() == ["every rank: hello", "rank 0: hello", "rank 1: hello"]
        assert ray.get([actor.take_notes.remote() for actor in group.actors]) == [[], []]  # nothing left behind
        with pytest.raises(Exception, match="on purpose"):
            group.run(SayingWorker.fail)
        assert capsys.readouterr().out.splitlines() == ["rank 0: about to fail", "rank 1: about to fail"]
        with pytest.raises(Exception, match="rank 1 on purpose"):  # rank 0's lines came back with its result
            group.run(SayingWorker.fail_on_rank_1)
        assert capsys.readouterr().out.splitlines() == ["rank 0: started", "rank 1: started"]
    finally:
        group.shutdown()
