"""`flexrl.trainer.collective_timeout_s`: validated, and the policy group's timeout where set."""

from __future__ import annotations

import pytest

from flexrl_ds.trainer.config import TrainerConfig


def test_the_group_timeout_is_the_collective_one_where_set_else_timeout_s():
    assert TrainerConfig(timeout_s=300.0).group_timeout_s == 300.0
    assert TrainerConfig(timeout_s=300.0, collective_timeout_s=30.0).group_timeout_s == 30.0


@pytest.mark.parametrize("value", [0.0, -5.0, 301.0])
def test_a_collective_timeout_not_in_0_to_timeout_s_is_refused(value):
    with pytest.raises(ValueError, match=r"flexrl.trainer.collective_timeout_s: must be positive and at most timeout_s"):
        TrainerConfig(timeout_s=300.0, collective_timeout_s=value)


def test_max_restarts_is_off_by_default_and_not_negative():
    assert TrainerConfig().max_restarts == 0
    with pytest.raises(ValueError, match="flexrl.trainer.max_restarts: must be >= 0"):
        TrainerConfig(max_restarts=-1)


def test_a_lost_rank_or_a_worker_ray_lost_is_restartable_a_worker_s_own_error_is_not():
    import ray

    from flexrl_ds.runtime.rank_failures import LostRanks, is_lost_worker

    assert is_lost_worker(LostRanks("policy.train", {1: "died: killed"}))
    engine = RuntimeError("rollout engines.generate: a worker died")
    engine.__cause__ = ray.exceptions.RayActorError()
    at_step = RuntimeError("... At step 2")
    at_step.__cause__ = engine
    assert is_lost_worker(engine) and is_lost_worker(at_step)
    assert not is_lost_worker(ValueError("reward: failed on all samples"))
