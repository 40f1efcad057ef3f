"""How the weight channel moves buckets, from where its ranks compute (runtime/weight_channel.py)."""

from __future__ import annotations

import itertools

import pytest

from flexrl_ds.runtime.weight_channel import BETWEEN_GPUS, HOST_MEMORY, SAME_GPU, choose_transport


def _expected(gpu_allowed: bool, device_ids: list) -> str:
    """The rule, spelled out case by case: shared in place only if every receiver is on the
    sender's GPU; NCCL only if no two ranks share a GPU; host memory for anything else."""
    if not gpu_allowed or None in device_ids:
        return HOST_MEMORY
    sender, receivers = device_ids[0], device_ids[1:]
    if set(receivers) == {sender}:
        return SAME_GPU
    if all(a != b for a, b in itertools.combinations(device_ids, 2)):
        return BETWEEN_GPUS
    return HOST_MEMORY


@pytest.mark.parametrize("size", [2, 3, 4])
def test_every_placement_of_up_to_four_ranks_on_three_gpus(size):
    for placement in itertools.product(["gpu-a", "gpu-b", "gpu-c", None], repeat=size):
        for gpu_allowed in (True, False):
            assert choose_transport(gpu_allowed, list(placement)) == _expected(gpu_allowed, list(placement)), placement


def test_the_cases_the_trainer_meets():
    assert choose_transport(True, ["gpu-0", "gpu-0"]) == SAME_GPU  # one engine sharing policy rank 0's GPU
    assert choose_transport(True, ["gpu-0", "gpu-1", "gpu-2"]) == BETWEEN_GPUS  # engines on GPUs of their own
    assert choose_transport(True, ["gpu-0", "gpu-0", "gpu-1"]) == HOST_MEMORY  # NCCL refuses two ranks on gpu-0
    assert choose_transport(True, ["gpu-0", None]) == HOST_MEMORY  # a CPU engine
    assert choose_transport(False, ["gpu-0", "gpu-0"]) == HOST_MEMORY  # GPUs not to be used (CPU run)
