"""PolicyWorker.generate around a colocated engine: the policy's states leave the device for the
rollout, torch's cached blocks go back to it before the engine wakes, and the states come back
whatever happens in the rollout. Stand-ins for the engine, for `zero3.RolloutOffload` and for the
cache's release record the order of calls (the real offload: tests/distributed/test_grpo_update.py,
tests/gpu/test_rollout_offload_gpu.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flexrl_ds.trainer import policy_worker
from flexrl_ds.trainer.policy_worker import PolicyWorker
from flexrl_ds.trainer.rollout_host import ROLLOUT_PARTS


GIB = 2**30
DEVICE_IN_USE = {"offload": 60 * GIB, "release": 40 * GIB, "wake": 70 * GIB, "generate": 85 * GIB,
                 "sleep": 45 * GIB, "reload": 90 * GIB}
"""Bytes in use on the stand-in device after each call; before the first: 100 GiB (the sync's level)."""


class StandInRollout:
    def __init__(self, log: list, fails_in: str = ""):
        self.log, self.fails_in = log, fails_in

    def _call(self, name: str):
        self.log.append(name)
        if name == self.fails_in:
            raise RuntimeError(f"{name} failed")
        self.usage.sample()  # the monitor's thread, sampling while generation runs

    def wake(self):
        self._call("wake")

    def sleep(self):
        self._call("sleep")

    def generate(self, step, jobs, params):
        self._call("generate")
        return SimpleNamespace(times_s={"generate": 0.0})


class StandInOffload:
    def __init__(self, log: list, refuses: bool = False, fails: bool = False):
        self.log, self.refuses, self.fails, self.moved, self.refusal = log, refuses, fails, (), ""

    def offload(self):
        self.log.append("offload")
        self.usage.sample()
        if self.refuses:
            raise AssertionError("Moving states across devices is not supported without an optimizer.")
        if self.fails:  # e.g. out of pinned host memory: RolloutOffload brings back what moved first
            raise RuntimeError("offload failed")
        self.moved = ("lp_params",)
        return self.moved

    def offloaded(self):
        return self.moved

    def reload(self):
        self.log.append("reload")
        self.usage.sample()
        self.moved = ()


@pytest.fixture(autouse=True)
def log_cache_release(monkeypatch):
    """The log of each test, where the release of torch's cached blocks writes "release"."""
    log: list = []
    monkeypatch.setattr(policy_worker.device_mod, "release_cached_memory", lambda info: log.append("release"))
    return log


def worker(log: list, gpu: bool = True, fails_in: str = "", refuses: bool = False) -> PolicyWorker:
    """fails_in: "wake", "generate" or "sleep" (the engine's) or "offload" (the states' move)."""
    """A PolicyWorker with only what `generate` uses (no process group, no DeepSpeed engine)."""
    stand_in = PolicyWorker.__new__(PolicyWorker)
    stand_in.rank, stand_in._offload_reported = 0, False
    stand_in.device_info = SimpleNamespace(is_gpu=gpu)
    stand_in.rollout = StandInRollout(log, fails_in)
    stand_in.rollout_offload = StandInOffload(log, refuses, fails=fails_in == "offload")
    in_use = lambda: DEVICE_IN_USE.get(log[-1], 0) if log else 100 * GIB  # noqa: E731
    stand_in.device_usage = policy_worker.device_mod.DeviceUsageMonitor(
        SimpleNamespace(is_gpu=False), used_bytes=in_use if gpu else None, poll=False)
    stand_in.rollout.usage = stand_in.rollout_offload.usage = stand_in.device_usage
    return stand_in


def test_states_leave_for_the_rollout_and_come_back(capsys, log_cache_release):
    log = log_cache_release
    rank = worker(log)
    rank.device_usage.reset()  # the driver's, before the phase
    output = rank.generate(0, [], None)
    assert log == ["offload", "release", "wake", "generate", "sleep", "reload"]
    assert set(output.times_s) == set(ROLLOUT_PARTS) - {"pixels"}  # the stand-in host pulls no pixels
    assert all(seconds >= 0 for seconds in output.times_s.values())
    # the device's peak from the wake to the end of generation: not the offload's 60 or the reload's 90
    assert output.engine_peak_bytes == 85 * GIB
    assert rank.device_usage.peak_bytes() == 100 * GIB  # the phase's peak, started before the window
    rank.generate(1, [], None)
    assert capsys.readouterr().out.count("in host memory during rollout: lp_params") == 1  # said once


@pytest.mark.parametrize("fails_in", ["wake", "generate", "sleep"])
def test_states_come_back_when_the_rollout_fails(fails_in, log_cache_release):
    log = log_cache_release
    with pytest.raises(RuntimeError, match=f"{fails_in} failed"):
        worker(log, fails_in=fails_in).generate(0, [], None)
    assert log[0] == "offload" and log[-2:] == ["sleep", "reload"]


def test_an_engine_never_woken_is_not_put_to_sleep(log_cache_release):
    """A failed move (not a refusal) ends the rollout before the wake: a sleep then would only free
    what the last sync wrote (hf at level 2) or wake vLLM's cache next to the policy's states."""
    log = log_cache_release
    with pytest.raises(RuntimeError, match="offload failed"):
        worker(log, fails_in="offload").generate(0, [], None)
    assert log == ["offload"]


def test_states_that_cannot_move_stay_and_are_not_asked_again(capsys, log_cache_release):
    log = log_cache_release
    rank = worker(log, refuses=True)
    rank.generate(0, [], None)
    rank.generate(1, [], None)  # the cache still goes back before each wake
    assert log == ["offload", "release", "wake", "generate", "sleep", "release", "wake", "generate", "sleep"]
    assert rank.rollout_offload is None
    assert capsys.readouterr().out.count("ZeRO-3 states stay on the device during rollout") == 1


def test_nothing_moves_on_a_cpu_rank(log_cache_release):
    log = log_cache_release
    output = worker(log, gpu=False).generate(0, [], None)
    assert log == ["wake", "generate", "sleep"]
    assert output.engine_peak_bytes == 0
    assert output.times_s["offload"] >= 0 and output.times_s["reload"] >= 0  # every part, also on a CPU rank
