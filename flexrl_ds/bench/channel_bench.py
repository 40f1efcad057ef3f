"""`flexrl bench channel`: the weight channel's transports timed against each other, in one run.

A sender process (policy rank 0's part: `WeightChannel.send` of ZeRO-3-sized buckets) and receiver
processes (a separate engine's part: `WeightChannel.load_each`, copying every tensor into weights
of its own) exchange `total_gib` of bf16 tensors, `rounds` times, per transport:
- on one GPU: `same_gpu` (every rank on that GPU, each bucket shared in place by CUDA IPC) against
  `host_memory` (the same ranks with the GPU transports off: gloo through host memory, the only way
  before CUDA IPC, since NCCL refuses two ranks on one GPU);
- on two GPUs or more: also `between_gpus` (NCCL), one GPU per rank;
- on CPU: `host_memory` only.
A sync's time runs from the sender's start to the last receiver's end (wall clocks of one machine);
every receiver's copy is checked against the sender's weights (per-tensor sums) after the last round. The extra
memory is the device's (CPU: none measured) peak above the weights themselves, per side.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from flexrl_ds.models.weights import group_by_bytes, tensor_bytes
from flexrl_ds.parallel import device as device_mod
from flexrl_ds.runtime.weight_channel import BETWEEN_GPUS, HOST_MEMORY, SAME_GPU, ChannelAddress, WeightChannel
from flexrl_ds.runtime.worker_group import open_store

logger = logging.getLogger(__package__)


@dataclass(frozen=True)
class ChannelBenchConfig:
    total_gib: float = 6.0
    """Weights sent per sync (6 GiB: a 3B-shaped policy in bf16)."""
    tensor_mib: float = 64.0
    bucket_mib: float = 512.0
    receivers: int = 1
    rounds: int = 3
    timeout_s: float = 600.0


@dataclass
class TransportResult:
    transport: str
    """Agreed by the ranks (may differ from the one asked for: then the placement did not allow it)."""
    placement: list
    """GPU index per rank (None: CPU)."""
    sync_s: list[float] = field(default_factory=list)
    gib_per_s: float = 0.0
    extra_gib_sender: float = 0.0
    extra_gib_receiver: float = 0.0
    checksums_match: bool = False
    """Every receiver's per-tensor sums equal the sender's after the last round."""


def _weights(config: ChannelBenchConfig, device: torch.device, fill: bool) -> list[tuple[str, torch.Tensor]]:
    count = max(1, round(config.total_gib * 1024 / config.tensor_mib))
    numel = int(config.tensor_mib * 2**20) // 2
    generator = torch.Generator(device="cpu").manual_seed(0)
    return [(f"layer{i}.weight", (torch.randn(numel, generator=generator, dtype=torch.float32).to(torch.bfloat16)
                                  if fill else torch.zeros(numel, dtype=torch.bfloat16)).to(device))
            for i in range(count)]


def _checksum(weights: list[tuple[str, torch.Tensor]]) -> list[float]:
    return [float(tensor.float().sum()) for _, tensor in weights]


def join_channel(rank: int, size: int, ports, use_gpu: bool, timeout_s: float) -> WeightChannel:
    """Rank `rank` of a channel of processes on this machine: rank 0 opens the store and hands its
    port to the others through the queue `ports`; every rank joins (blocks until all have)."""
    store = open_store("127.0.0.1", size, timeout_s) if rank == 0 else None
    if rank == 0:
        for _ in range(size - 1):
            ports.put(store.port)
    port = store.port if rank == 0 else ports.get(timeout=timeout_s)
    return WeightChannel(ChannelAddress("127.0.0.1", port, size, timeout_s, use_gpu=use_gpu), rank, store)


def _run_rank(target: Callable, rank: int, size: int, args: tuple, ports, results) -> None:
    try:
        results.put((rank, True, target(rank, size, ports, *args)))
    except Exception:  # noqa: BLE001 - the parent reports every rank's failure
        results.put((rank, False, traceback.format_exc()))


def run_ranks(target: Callable, args_per_rank: list[tuple], timeout_s: float) -> dict[int, Any]:
    """`target(rank, size, ports, *args_per_rank[rank])` in a spawned process per rank (a module-level
    function; `ports` for `join_channel`); {rank: what it returned}. Raises with every failed rank's
    traceback; a rank still running after its report's deadline is terminated, not waited for."""
    context = multiprocessing.get_context("spawn")
    ports, results = context.Queue(), context.Queue()
    size = len(args_per_rank)
    processes = [context.Process(target=_run_rank, args=(target, rank, size, tuple(args), ports, results), daemon=True)
                 for rank, args in enumerate(args_per_rank)]
    for process in processes:
        process.start()
    try:
        reports = [results.get(timeout=timeout_s) for _ in processes]
    finally:  # a rank stuck in a collective must not keep the caller waiting
        for process in processes:
            process.join(timeout=60)
            if process.is_alive():
                process.terminate()
    failed = {rank: value for rank, ok, value in reports if not ok}
    if failed:
        raise RuntimeError(f"{target.__name__}: ranks {sorted(failed)} failed:\n"
                           + "\n".join(f"--- rank {rank} ---\n{failed[rank]}" for rank in sorted(failed)))
    return {rank: value for rank, _, value in reports}


def _rank_process(rank: int, size: int, ports, gpu: int | None, gpu_transports: bool,
                  config: ChannelBenchConfig) -> tuple:
    info = device_mod.GPU if gpu is not None else device_mod.CPU
    device = device_mod.set_local_device(info, gpu or 0)
    weights = _weights(config, device, fill=rank == 0)
    device_mod.synchronize(info)
    base = device_mod.max_memory_allocated(info)
    channel = join_channel(rank, size, ports, gpu_transports, config.timeout_s)
    targets = dict(weights)
    stamps = []
    for _ in range(config.rounds):
        started = time.time()
        if rank == 0:
            channel.send(group_by_bytes(weights, tensor_bytes, int(config.bucket_mib * 2**20)))
        else:
            channel.load_each(lambda bucket: [targets[name].copy_(tensor) for name, tensor in bucket])  # type: ignore[arg-type]
        device_mod.synchronize(info)
        stamps.append((started, time.time()))
    extra = (device_mod.max_memory_allocated(info) - base) / 2**30
    return channel.transport, stamps, extra, _checksum(weights)


def run_transport(config: ChannelBenchConfig, placement: list[int | None], gpu_transports: bool) -> TransportResult:
    """One channel of len(placement) ranks (rank r on GPU placement[r]; gpu_transports: the
    channel may use them), timed over config.rounds syncs."""
    reports = run_ranks(_rank_process, [(gpu, gpu_transports, config) for gpu in placement], config.timeout_s)
    result = TransportResult(reports[0][0], list(placement))
    for index, (started, _) in enumerate(reports[0][1]):
        result.sync_s.append(max(reports[rank][1][index][1] for rank in reports) - started)
    result.gib_per_s = config.total_gib / min(result.sync_s)
    result.extra_gib_sender = reports[0][2]
    result.extra_gib_receiver = max(reports[rank][2] for rank in reports if rank > 0)
    result.checksums_match = all(reports[rank][3] == reports[0][3] for rank in reports)
    return result


def placements(num_gpus: int, receivers: int) -> dict[str, tuple[list[int | None], bool]]:
    """Per transport this machine can show: (GPU index per rank, whether the channel may use GPUs)."""
    if num_gpus == 0:
        return {HOST_MEMORY: ([None] * (1 + receivers), False)}
    same = [0] * (1 + receivers)
    chosen = {SAME_GPU: (same, True), HOST_MEMORY: (same, False)}
    if num_gpus > receivers:
        chosen[BETWEEN_GPUS] = (list(range(1 + receivers)), True)
    return chosen


def run_channel_bench(config: ChannelBenchConfig) -> list[dict]:
    """Every transport this machine can show, one after another; results as dicts (for JSON)."""
    rows = []
    for asked, (placement, gpu_transports) in placements(device_mod.num_gpus(), config.receivers).items():
        result = run_transport(config, placement, gpu_transports)
        rows.append(asdict(result) | {"asked": asked})
        logger.info(f"[bench channel] {asked}: agreed {result.transport}, {config.total_gib:g} GiB per sync in "
                    f"{', '.join(f'{s:.2f}' for s in result.sync_s)} s ({result.gib_per_s:.1f} GiB/s best); "
                    f"extra GiB sender {result.extra_gib_sender:.2f}, receiver {result.extra_gib_receiver:.2f}; "
                    f"receivers' checksums match the sender's: {result.checksums_match}")
    return rows
