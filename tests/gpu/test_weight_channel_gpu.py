"""The weight channel's NCCL path (issue 10): policy rank 0 -> engines on GPUs of their own.

Each rank is a spawned process on its own GPU; rank 0 opens the channel's TCPStore and broadcasts
seeded buckets of mixed dtypes and odd sizes (the CPU test's, tests/distributed/test_weight_channel.py)
over `WeightChannel(use_gpu=True)`; every receiver checks them against the same buckets made on its
own, bit for bit, for several syncs. Needs two GPUs: NCCL refuses two ranks on one device
("Duplicate GPU detected"), which `python3 tests/gpu/test_weight_channel_gpu.py same-gpu` shows on
a one-GPU machine (`... cpu` runs the same harness over gloo). Run by tests/gpu/run_vllm_on_gpu_machine.sh.
"""

from __future__ import annotations

import multiprocessing
import sys
import traceback

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


def _channel_process(rank: int, gpu: int | None, size: int, rounds: int, ports, results) -> None:
    try:
        if gpu is not None:
            torch.cuda.set_device(gpu)
        sys.path.insert(0, "tests/distributed")
        from test_weight_channel import seeded_buckets

        from flexrl_ds.runtime.weight_channel import ChannelAddress, WeightChannel, open_store

        store = None
        if rank == 0:
            store = open_store("127.0.0.1", size, 120)
            for _ in range(size - 1):
                ports.put(store.port)
            port = store.port
        else:
            port = ports.get(timeout=120)
        channel = WeightChannel(ChannelAddress("127.0.0.1", port, size, timeout_s=120, use_gpu=gpu is not None), rank, store)
        report = []
        for round_index in range(rounds):
            expected = seeded_buckets(round_index)
            if rank == 0:
                report.append(channel.send(expected))
                continue
            got = list(channel.receive())
            report.append(len(got) == len(expected) and all(
                [n for n, _ in g] == [n for n, _ in e] and all(
                    a.is_cuda == (gpu is not None) and a.dtype == b.dtype and torch.equal(a.cpu(), b) for (_, a), (_, b) in zip(g, e))
                for g, e in zip(got, expected)))
        if gpu is not None:
            torch.cuda.synchronize()
        results.put((rank, report))
    except Exception:  # noqa: BLE001 - the parent reports every rank's failure
        results.put((rank, traceback.format_exc()))


def run_channel(gpus: list[int | None], rounds: int = 3) -> dict[int, object]:
    """Rank r on GPU gpus[r] (None: on the CPU, over gloo: a check of this harness); returns {rank: per-sync report, or the traceback of its failure}."""
    context = multiprocessing.get_context("spawn")
    ports, results = context.Queue(), context.Queue()
    processes = [context.Process(target=_channel_process, args=(rank, gpu, len(gpus), rounds, ports, results),
                                 daemon=True) for rank, gpu in enumerate(gpus)]
    for process in processes:
        process.start()
    try:
        reports = dict(results.get(timeout=300) for _ in processes)
    finally:  # a rank stuck in NCCL must not keep the test (or pytest's exit) waiting
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.terminate()
    return reports


def test_nccl_channel_broadcasts_every_bucket_between_gpus():
    gpus = list(range(min(torch.cuda.device_count(), 4)))
    reports = run_channel(gpus)
    assert all(isinstance(sent, int) and sent > 0 for sent in reports[0]), reports[0]
    assert [reports[rank] for rank in gpus[1:]] == [[True] * 3] * (len(gpus) - 1), reports


if __name__ == "__main__":
    devices = {"same-gpu": [0, 0], "cpu": [None, None]}[sys.argv[1]]
    for rank, report in sorted(run_channel(devices, rounds=1).items()):
        print(f"rank {rank} on {devices[rank]}: {report if isinstance(report, list) else report[-400:]}")
