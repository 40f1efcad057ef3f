"""Pure parts of separate rollout engines and their weight channel."""

import pytest

from flexrl_ds.rollout.vllm_workers import WeightReceiverExtension
from flexrl_ds.trainer.rollout_group import SeparateRollout, channel_first_ranks, channel_may_use_gpus


def test_hosts_take_consecutive_channel_ranks_after_the_sender():
    # a tensor-parallel engine of 2 shards, an engine of 1, another of 2: ranks 1-2, 3, 4-5
    assert channel_first_ranks([2, 1, 2]) == [1, 3, 4]
    assert channel_first_ranks([1, 1, 1]) == [1, 2, 3]
    assert channel_first_ranks([]) == []


def test_worker_extension_only_adds_flexrl_names():
    """vLLM refuses an extension defining a name its Worker has; it only checks when an engine starts
    on a GPU, so the names are checked here."""
    added = [name for name in dir(WeightReceiverExtension) if not name.startswith("__")]
    assert added and all(name.startswith("flexrl_") for name in added), added


def test_a_share_of_a_gpu_counts_as_a_gpu_for_the_channel():
    """One GPU shared by the policy rank and the engine (0.5 each) must reach the in-place transport:
    a check of whole GPUs only (>= 1) once left it in host memory (11 s per 3B sync on an H200)."""
    assert channel_may_use_gpus(0.5, 0.5)
    assert channel_may_use_gpus(1, 1) and channel_may_use_gpus(1, 0.25)
    assert not channel_may_use_gpus(0, 1) and not channel_may_use_gpus(1, 0) and not channel_may_use_gpus(0, 0)


class _PolicyFailingToSend:
    def __init__(self):
        self.calls = 0

    def run_async(self, method, *args):
        self.calls += 1
        raise RuntimeError(f"policy.{method.__name__}: rank 1 died\n(traceback)")


def test_a_failed_sync_leaves_the_channel_refusing_further_syncs():
    """A sync that failed may leave ranks anywhere in a bucket: a later sync over the same channel
    would hang or load a mix of two updates, so it is refused with the first failure's reason."""
    rollout = SeparateRollout.__new__(SeparateRollout)
    rollout.hosts, rollout.timeout_s, rollout.transport, rollout.channel_broken = [], 5.0, "host_memory", None
    policy = _PolicyFailingToSend()
    with pytest.raises(RuntimeError, match="rank 1 died"):
        rollout.sync(policy, bucket_bytes=1 << 20)
    with pytest.raises(RuntimeError, match=r"unusable since a sync failed \(RuntimeError: policy.send_weights: "
                                           r"rank 1 died\).*--resume"):
        rollout.sync(policy, bucket_bytes=1 << 20)
    assert policy.calls == 1  # the second sync never reached the policy
