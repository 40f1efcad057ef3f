"""`flexrl bench channel` (bench/channel_bench.py): where its ranks sit, and a small run on CPU."""

from __future__ import annotations

from flexrl_ds.bench.channel_bench import ChannelBenchConfig, placements, run_transport
from flexrl_ds.runtime.weight_channel import BETWEEN_GPUS, HOST_MEMORY, SAME_GPU


def test_placements_show_what_each_machine_can():
    assert placements(0, 2) == {HOST_MEMORY: ([None, None, None], False)}
    assert placements(1, 1) == {SAME_GPU: ([0, 0], True), HOST_MEMORY: ([0, 0], False)}
    assert placements(2, 1)[BETWEEN_GPUS] == ([0, 1], True)
    assert BETWEEN_GPUS not in placements(2, 2)  # three ranks need three GPUs


def test_cpu_run_delivers_every_weight_and_times_each_round():
    config = ChannelBenchConfig(total_gib=1 / 64, tensor_mib=1.0, bucket_mib=4.0, receivers=2, rounds=2)
    result = run_transport(config, [None, None, None], gpu_transports=False)
    assert result.transport == HOST_MEMORY and result.checksums_match
    assert len(result.sync_s) == 2 and all(s > 0 for s in result.sync_s)
    assert result.gib_per_s > 0


def _fails_on_rank_one(rank: int, size: int, ports) -> int:
    if rank == 1:
        raise ValueError("rank one's own failure")
    return rank * 10


def test_run_ranks_returns_each_rank_and_raises_with_a_failed_ranks_traceback():
    import pytest

    from flexrl_ds.bench.channel_bench import run_ranks

    assert run_ranks(_fails_on_rank_one, [()], timeout_s=120) == {0: 0}
    with pytest.raises(RuntimeError, match="rank one's own failure"):
        run_ranks(_fails_on_rank_one, [(), ()], timeout_s=120)
