"""zero3.RolloutOffload's choice of states, on a stand-in for a DeepSpeed engine that refuses what
DeepSpeed 0.19 refuses (the real engine: tests/distributed/test_grpo_update.py)."""

from __future__ import annotations

import pytest
import torch

from flexrl_ds.models.zero3 import STATES_ANY_OPTIMIZER, RolloutOffload

ALL_STATES = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")
FUSED_ADAM_ONLY = "Offloading is supported only for DeepSpeed FusedAdam."


class StandInEngine:
    """offload_states / reload_states with DeepSpeed's refusals: `refuses` the states it will not move
    (an AssertionError `message` before anything moves, as DeepSpeed checks first; "everything": any
    call); `fails_after` moves that many of the asked states, then raises a RuntimeError."""

    def __init__(self, refuses: tuple[str, ...] = (), message: str = FUSED_ADAM_ONLY, fails_after: int | None = None):
        self.refuses, self.message, self.fails_after = refuses, message, fails_after
        self.module = torch.nn.Linear(2, 2)
        self.optimizer = type("Optimizer", (), {})()
        self.optimizer.offloaded_states = set()
        self.calls: list = []
        self.reloads = 0

    def offload_states(self, include=None):
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

        self.calls.append(None if include is None else sorted(state.value for state in include))
        asked = ALL_STATES if include is None else tuple(state.value for state in include)
        if "everything" in self.refuses or set(asked) & set(self.refuses):
            raise AssertionError(self.message)
        for index, name in enumerate(asked):
            if index == self.fails_after:
                raise RuntimeError("out of pinned host memory")
            self.optimizer.offloaded_states.add(OffloadStateTypeEnum(name))

    def reload_states(self):
        self.reloads += 1
        self.optimizer.offloaded_states = set()


def test_every_state_moves_where_deepspeed_allows_it():
    engine = StandInEngine()
    mover = RolloutOffload(engine)
    assert mover.offload() == tuple(sorted(ALL_STATES))
    assert (mover.include, mover.refusal, engine.calls) == (None, "", [None])
    mover.reload()
    assert mover.offloaded() == ()


def test_a_refusal_of_the_fp32_states_moves_the_others_from_then_on():
    engine = StandInEngine(refuses=("optim_states", "hp_params"))
    mover = RolloutOffload(engine)
    assert mover.offload() == tuple(sorted(STATES_ANY_OPTIMIZER))
    assert mover.refusal == FUSED_ADAM_ONLY
    mover.reload()
    assert mover.offload() == tuple(sorted(STATES_ANY_OPTIMIZER))
    assert engine.calls == [None] + [sorted(STATES_ANY_OPTIMIZER)] * 2  # asked for everything once only


def test_an_engine_that_moves_nothing_raises():
    mover = RolloutOffload(StandInEngine(refuses=("everything",)))
    with pytest.raises(AssertionError, match="FusedAdam"):
        mover.offload()


def test_another_refusal_is_not_retried():
    """Only DeepSpeed's FusedAdam refusal means 'the other states can move'."""
    engine = StandInEngine(refuses=("everything",), message="Moving states across devices is not supported "
                                                             "for offloaded parameters.")
    with pytest.raises(AssertionError, match="offloaded parameters"):
        RolloutOffload(engine).offload()
    assert engine.calls == [None]


def test_frozen_parameters_are_refused_before_anything_moves():
    engine = StandInEngine()
    engine.module.bias.requires_grad_(False)
    with pytest.raises(NotImplementedError, match=r"frozen parameters \(1, e.g. bias\)"):
        RolloutOffload(engine).offload()
    assert engine.calls == []


def test_a_move_that_fails_part_way_brings_back_what_moved():
    engine = StandInEngine(fails_after=2)
    mover = RolloutOffload(engine)
    with pytest.raises(RuntimeError, match="out of pinned host memory"):
        mover.offload()
    assert engine.reloads == 1 and mover.offloaded() == ()


def test_states_left_on_the_host_by_a_reload_are_an_error():
    engine = StandInEngine()
    mover = RolloutOffload(engine)
    mover.offload()
    engine.reload_states = lambda: None
    with pytest.raises(RuntimeError, match="left states in host memory"):
        mover.reload()
