"""LostRanks' message: the lost ranks, every survivor by name with the lost ranks and the step, and
where --resume continues (runtime/rank_failures.py; the Ray side: tests/ray/test_lost_ranks.py)."""

from __future__ import annotations

from flexrl_ds.runtime.rank_failures import LostRanks


def test_every_survivor_is_named_with_the_lost_rank_and_the_step():
    lost = LostRanks("policy.train", {2: "(pid 11) stalled: no answer 35 s after the first rank's answer or failure"},
                     survivors={0: "RuntimeError: Timed out waiting 30000ms for recv", 1: "RuntimeError: timed out"},
                     waited_s=30.4, answered=[3])
    plain = str(lost)
    assert plain.splitlines()[0] == "policy.train: lost rank 2: rank 2 (pid 11) stalled: no answer 35 s after the first rank's answer or failure"
    said = str(lost.at(4, "OUT/checkpoints/step_3")).splitlines()
    survivors = [line for line in said if "(survivor)" in line]
    assert [line.split()[1] for line in survivors] == ["0", "1", "3"]
    assert all("at step 5 (0-based 4) after losing rank 2" in line for line in survivors)
    assert said[-1] == "  the run can go on with --resume, from OUT/checkpoints/step_3"
    assert "every survivor failed within 30.4 s" in "\n".join(said)
    assert "start over" in str(lost.at(0, ""))


def test_a_lost_engine_s_line_gets_the_step_and_the_checkpoint():
    from flexrl_ds.runtime.rank_failures import lost_at_step

    said = str(lost_at_step(RuntimeError("weight sync: a worker died (killed)."), 1, "OUT/checkpoints/step_0"))
    assert said == ("weight sync: a worker died (killed). At step 2 (0-based 1); the run can go on with --resume, "
                    "from OUT/checkpoints/step_0")
    assert "(survivor) stopped at step 2" not in said
    assert str(lost_at_step(LostRanks("policy.train", {1: "died"}), 1, "")).endswith("--resume would start over")
