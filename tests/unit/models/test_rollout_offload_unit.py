"""zero3.RolloutOffload's choice of states, on a stand-in for a DeepSpeed engine that refuses what
DeepSpeed 0.19 refuses (the real engine: tests/distributed/test_grpo_update.py)."""

from __future__ import annotations

import pytest

from flexrl_ds.models.zero3 import STATES_ANY_OPTIMIZER, RolloutOffload

ALL_STATES = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")


class StandInEngine:
    """offload_states / reload_states with DeepSpeed's refusals: `refuses` the states it will not move
    (an AssertionError before anything moves, as DeepSpeed checks first); "everything" refuses any call."""

    def __init__(self, refuses: tuple[str, ...] = ()):
        self.refuses = refuses
        self.optimizer = type("Optimizer", (), {})()
        self.optimizer.offloaded_states = set()
        self.calls: list = []

    def offload_states(self, include=None):
        self.calls.append(None if include is None else sorted(state.value for state in include))
        asked = ALL_STATES if include is None else tuple(state.value for state in include)
        if "everything" in self.refuses or set(asked) & set(self.refuses):
            raise AssertionError("Offloading is supported only for DeepSpeed FusedAdam.")
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

        self.optimizer.offloaded_states |= {OffloadStateTypeEnum(name) for name in asked}

    def reload_states(self):
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
    assert "FusedAdam" in mover.refusal
    mover.reload()
    assert mover.offload() == tuple(sorted(STATES_ANY_OPTIMIZER))
    assert engine.calls == [None] + [sorted(STATES_ANY_OPTIMIZER)] * 2  # asked for everything once only


def test_an_engine_that_moves_nothing_raises():
    mover = RolloutOffload(StandInEngine(refuses=("everything",)))
    with pytest.raises(AssertionError):
        mover.offload()
