"""flexrl.trainer.profile_step outside the run's steps is said at the start (nothing would be profiled)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flexrl_ds.trainer.config import TrainerConfig
from flexrl_ds.trainer.driver import GRPOTrainer


def stand_in(profile_step, start_step=0, max_steps=3) -> GRPOTrainer:
    trainer = GRPOTrainer.__new__(GRPOTrainer)  # only what `run` uses; steps do nothing
    trainer.o = SimpleNamespace(profile_step=profile_step, start_step=start_step, max_steps=max_steps,
                                save_last=False, save_every=0)
    trainer.train_step = lambda step: {"step": step}
    trainer.policy = SimpleNamespace(note_step=lambda step: None)  # the worker group told each step
    return trainer


@pytest.mark.parametrize("profile_step, start_step, said", [(5, 0, True), (3, 0, True), (0, 1, True),
                                                           (2, 0, False), (1, 1, False), (None, 0, False)])
def test_a_profile_step_outside_the_run_is_said(capsys, profile_step, start_step, said):
    assert [row["step"] for row in stand_in(profile_step, start_step).run()] == list(range(start_step, 3))
    out = capsys.readouterr().out
    assert (f"flexrl.trainer.profile_step {profile_step} is not one of this run's steps {start_step}..2: "
            "nothing is profiled" in out) == said


def test_a_negative_profile_step_is_refused():
    with pytest.raises(ValueError, match="flexrl.trainer.profile_step: must be >= 0, got -1"):
        TrainerConfig(profile_step=-1)
