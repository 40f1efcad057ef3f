"""A device OOM inside a phase ends the run with one line naming the phase, its peak and the settings
to change (trainer/device_oom.py), injected on CPU as torch's OOM type into the phase methods."""

from __future__ import annotations

import types

import pytest
import torch

from flexrl_ds.parallel import device as device_mod
from flexrl_ds.trainer.device_oom import DeviceOutOfMemory, naming_device_oom
from flexrl_ds.trainer.policy_worker import PolicyWorker


def oom(*_args, **_kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 79.19 GiB")


def fake_rank(**attributes):
    usage = device_mod.DeviceUsageMonitor(device_mod.CPU, used_bytes=lambda: 75 * 2**30, poll=False)
    return types.SimpleNamespace(rank=3, device_info=device_mod.CPU, device_usage=usage, **attributes)


def test_context_turns_only_device_oom_into_one_line():
    with pytest.raises(DeviceOutOfMemory) as raised:
        with naming_device_oom("update", 1, lambda: 70 * 2**30, lambda: 80 * 2**30):
            oom()
    said = str(raised.value)
    assert said.startswith("rank 1: out of device memory in the update phase (peak 70.0 GiB in use of the "
                           "device's 80.0 GiB; CUDA out of memory. Tried to allocate 2.50 GiB")
    assert "flexrl.trainer.activation_checkpointing" in said and "\n" not in said
    assert isinstance(raised.value, ValueError)  # `flexrl` prints ValueErrors as one line
    with pytest.raises(DeviceOutOfMemory, match="rollout phase .*gpu_memory_utilization"):
        with naming_device_oom("rollout", 0, lambda: 0, lambda: None):
            raise RuntimeError("CUDA Error: out of memory at /workspace/csrc/cumem_allocator.cpp:62")
    with pytest.raises(KeyError):  # any other error passes unchanged
        with naming_device_oom("update", 0, lambda: 0, lambda: None):
            raise KeyError("x")


def test_update_phase_method():
    with pytest.raises(DeviceOutOfMemory, match=r"^rank 3: out of device memory in the update phase \(peak 75\.0 GiB"):
        PolicyWorker.train(fake_rank(_batches=oom), None)


def test_logprobs_phase_method():
    with pytest.raises(DeviceOutOfMemory, match="in the logprobs phase .*logprob_chunk_bytes"):
        PolicyWorker.logprobs(fake_rank(_batches=oom, reference=None, policy=None),
                              types.SimpleNamespace(model="policy"))


def test_rollout_wake_oom_wins_over_the_failed_sleep(capsys):
    """vLLM's wake ran out of memory, then its sleep failed ('invalid argument'): the run ends with the
    wake's one line; the sleep's failure is said, not raised over it."""
    slept = []

    def failed_sleep():
        slept.append(True)
        raise RuntimeError("CUDA Error: invalid argument")

    rollout = types.SimpleNamespace(wake=lambda: oom(), sleep=failed_sleep)
    rank = fake_rank(rollout=rollout, rollout_offload=None, _offload_states=lambda: None)
    rank._sleep_and_reload = lambda woke, failed: PolicyWorker._sleep_and_reload(rank, woke, failed)
    with pytest.raises(DeviceOutOfMemory, match="in the rollout phase"):
        PolicyWorker.generate(rank, 0, [], None)
    assert slept == [True]
    # without a failed rollout, a failed sleep is raised as before
    with pytest.raises(RuntimeError, match="invalid argument"):
        PolicyWorker._sleep_and_reload(rank, True, False)

