"""Pure parts of separate rollout engines and their weight channel."""

from flexrl_ds.rollout.vllm_workers import WeightReceiverExtension
from flexrl_ds.trainer.rollout_group import channel_first_ranks, channel_may_use_gpus


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
