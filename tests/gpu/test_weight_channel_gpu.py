"""The weight channel's GPU transports (issue 10): policy rank 0 -> engines in processes of their own.

Each rank is a spawned process; rank 0 opens the channel's TCPStore and sends seeded buckets of
mixed dtypes and odd sizes (the CPU test's, tests/distributed/test_weight_channel.py) over
`WeightChannel(use_gpu=True)`; every receiver checks them against the same buckets made on its own,
bit for bit, for several syncs; every rank reports the transport agreed, and the sender that no
sync leaves device memory behind (torch frees a shared bucket only once every opener is done):
- ranks on GPUs of their own: NCCL (`BETWEEN_GPUS`; needs two GPUs);
- every rank on one GPU: shared in place by CUDA IPC (`SAME_GPU`; NCCL would refuse: "Duplicate GPU detected").
`flexrl bench channel` times the transports against each other. Run by tests/gpu/run_vllm_on_gpu_machine.sh.
"""

from __future__ import annotations

import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def _channel_process(rank: int, size: int, ports, gpu: int | None, rounds: int) -> list:
    if gpu is not None:
        torch.cuda.set_device(gpu)
    sys.path.insert(0, "tests/distributed")
    from test_weight_channel import seeded_buckets

    from flexrl_ds.bench.channel_bench import join_channel

    channel = join_channel(rank, size, ports, use_gpu=gpu is not None, timeout_s=120)
    report: list = [channel.transport]
    allocated = (lambda: torch.cuda.memory_allocated()) if gpu is not None else (lambda: 0)
    for round_index in range(rounds):
        expected = seeded_buckets(round_index)
        if rank == 0:
            before = allocated()
            sent = channel.send(expected)
            report.append((sent, allocated() - before))  # device bytes the sync left behind: none
            continue
        got = []  # copied out as each bucket arrives, as engines load (same_gpu: the views are the sender's memory)
        channel.load_each(lambda bucket: got.append([(name, tensor.clone()) for name, tensor in bucket]))
        report.append(len(got) == len(expected) and all(
            [n for n, _ in g] == [n for n, _ in e] and all(
                a.is_cuda == (gpu is not None) and a.dtype == b.dtype and torch.equal(a.cpu(), b) for (_, a), (_, b) in zip(g, e))
            for g, e in zip(got, expected)))
    if gpu is not None:
        torch.cuda.synchronize()
    return report


def run_channel(gpus: list[int | None], rounds: int = 3) -> dict[int, list]:
    """Rank r on GPU gpus[r] (None: on the CPU, over gloo: a check of this harness); returns
    {rank: [transport, per-sync report...]} (bench/channel_bench.run_ranks raises with the
    tracebacks of failed ranks)."""
    from flexrl_ds.bench.channel_bench import run_ranks

    return run_ranks(_channel_process, [(gpu, rounds) for gpu in gpus], timeout_s=300)


def _assert_delivered(reports: dict, transport: str) -> None:
    assert all(isinstance(report, list) and report[0] == transport for report in reports.values()), reports
    assert all(sent > 0 and left_behind == 0 for sent, left_behind in reports[0][1:]), reports[0]
    assert [reports[rank][1:] for rank in sorted(reports)[1:]] == [[True] * 3] * (len(reports) - 1), reports


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_channel_broadcasts_every_bucket_between_gpus():
    from flexrl_ds.runtime.weight_channel import BETWEEN_GPUS

    _assert_delivered(run_channel(list(range(min(torch.cuda.device_count(), 4)))), BETWEEN_GPUS)


def test_receivers_on_the_senders_gpu_get_every_bucket_shared_in_place():
    from flexrl_ds.runtime.weight_channel import SAME_GPU

    _assert_delivered(run_channel([0, 0]), SAME_GPU)
    _assert_delivered(run_channel([0, 0, 0]), SAME_GPU)  # two openers of every bucket

