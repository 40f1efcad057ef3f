"""WeightChannel: policy rank 0 -> engines over a private process group (gloo here, NCCL on GPUs),
next to an existing torch.distributed world (the pool's), buckets of mixed dtypes and odd sizes."""

from __future__ import annotations

import torch

from flexrl_ds.runtime.weight_channel import pack_bucket, unpack_bucket


def seeded_buckets(seed: int) -> list[list[tuple[str, torch.Tensor]]]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [[(3,), (5, 7)], [(1,)], [(2, 3, 5), ()], [(11,)]]
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
    return [[(f"b{b}.t{t}", (torch.randn(shape, generator=generator) * 10).to(dtypes[(b + t) % 4]))
             for t, shape in enumerate(bucket)] for b, bucket in enumerate(shapes)]


def test_pack_unpack_round_trip():
    for bucket in seeded_buckets(0):
        header, flat = pack_bucket(bucket, torch.device("cpu"))
        restored = unpack_bucket(header, flat.clone())
        assert [name for name, _ in restored] == [name for name, _ in bucket]
        for (_, got), (_, want) in zip(restored, bucket):
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)


def channel_rank(port_file: str, seed: int, rounds: int):
    import time
    from pathlib import Path

    import torch.distributed as dist

    from flexrl_ds.runtime.weight_channel import ChannelAddress, WeightChannel
    from flexrl_ds.runtime.worker_group import open_store

    rank, size = dist.get_rank(), dist.get_world_size()
    store = None
    if rank == 0:  # the sender opens the store on a port the OS picks and tells the others
        store = open_store("127.0.0.1", size, 120)
        Path(port_file).write_text(str(store.port))
    while not Path(port_file).exists() or not Path(port_file).read_text():
        time.sleep(0.05)
    address = ChannelAddress("127.0.0.1", int(Path(port_file).read_text()), size, timeout_s=120)
    channel = WeightChannel(address, rank, store)
    report = []
    for round_index in range(rounds):
        expected = seeded_buckets(seed + round_index)
        if rank == 0:
            report.append(channel.send(expected))
            continue
        got = [bucket for bucket in channel.receive()]
        same = len(got) == len(expected) and all(
            [n for n, _ in g] == [n for n, _ in e] and all(torch.equal(a, b) and a.dtype == b.dtype
                                                          for (_, a), (_, b) in zip(g, e))
            for g, e in zip(got, expected))
        report.append(same)
    return channel.transport, report


def test_weight_channel_broadcasts_every_bucket(dist_pools, tmp_path):
    from flexrl_ds.runtime.weight_channel import HOST_MEMORY

    results = dist_pools(4).run(channel_rank, str(tmp_path / "port"), 5, 2)
    assert [transport for transport, _ in results] == [HOST_MEMORY] * 4  # CPU ranks: agreed by all
    assert all(isinstance(sent, int) and sent > 0 for sent in results[0][1])
    assert [report for _, report in results[1:]] == [[True, True]] * 3


class _RecordingModel:
    def __init__(self):
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, named_tensors):
        self.loaded.extend((name, tensor.clone()) for name, tensor in named_tensors)


def engine_worker_rank(port_file: str, seed: int):
    """Channel rank 0 sends; ranks 1-2 are the two workers of one tensor-parallel vLLM engine
    (WeightReceiverExtension as vLLM mixes it into its Worker: `rank`, `get_model`), joining with
    first_rank 1; rank 3 is a host receiving for a single-worker engine."""
    import time
    from dataclasses import asdict
    from pathlib import Path

    import torch.distributed as dist

    from flexrl_ds.rollout.vllm_workers import WeightReceiverExtension
    from flexrl_ds.runtime.weight_channel import ChannelAddress, WeightChannel
    from flexrl_ds.runtime.worker_group import open_store

    class Worker(WeightReceiverExtension):
        def __init__(self, rank: int):
            self.rank, self.model = rank, _RecordingModel()

        def get_model(self):
            return self.model

    rank, size = dist.get_rank(), dist.get_world_size()
    store = open_store("127.0.0.1", size, 120) if rank == 0 else None
    if rank == 0:
        Path(port_file).write_text(str(store.port))
    while not Path(port_file).exists() or not Path(port_file).read_text():
        time.sleep(0.05)
    address = ChannelAddress("127.0.0.1", int(Path(port_file).read_text()), size, timeout_s=120)
    expected = [pair for bucket in seeded_buckets(seed) for pair in bucket]
    if rank == 0:
        return WeightChannel(address, 0, store).send(seeded_buckets(seed)) > 0
    if rank == 3:
        channel = WeightChannel(address, 3)
        got = [pair for bucket in channel.receive() for pair in bucket]
        return ("host", 3, [(n, t.dtype, t.tolist()) for n, t in got] == [(n, t.dtype, t.tolist()) for n, t in expected])
    worker = Worker(rank - 1)
    joined_as = worker.flexrl_join_weight_channel(asdict(address), first_rank=1)
    count = worker.flexrl_receive_weights()
    same = [(n, t.dtype, t.tolist()) for n, t in worker.model.loaded] == [(n, t.dtype, t.tolist()) for n, t in expected]
    return ("worker", joined_as, same and count == len(expected))


def test_engine_workers_join_as_consecutive_receivers_and_load_every_tensor(dist_pools, tmp_path):
    """A tensor-parallel engine's workers each receive the full tensors (vLLM keeps each shard's part)."""
    results = dist_pools(4).run(engine_worker_rank, str(tmp_path / "port"), 9)
    assert results == [True, ("worker", 1, True), ("worker", 2, True), ("host", 3, True)]
