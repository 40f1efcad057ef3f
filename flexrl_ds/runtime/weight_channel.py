"""Weights from policy rank 0 to rollout engines in other processes, over a process group of their own.

Engines that are not policy ranks (`SeparateRollout`) are outside the policy's torch.distributed
world, so `WeightChannel` builds a private group (parallel/device.new_private_group) of policy
rank 0 (rank 0 of the channel, the TCPStore's host) and the engines (ranks 1..R: one per engine
worker, so a tensor-parallel vLLM engine takes one per shard). A sync sends each ZeRO-3 bucket
(models/weights.iter_weight_buckets) as a small header (names, dtypes, shapes, as JSON
bytes) and one flat byte buffer holding the bucket's tensors at 16-byte aligned offsets; an empty
header ends the sync. Receivers load the buckets as they arrive, so no process holds more than one
bucket extra (the sender: the gathered bucket and its packed buffer) and no weight passes through
the Ray object store.

How the buffer travels (`transport`) is agreed at set-up from where the ranks are: each rank puts
its GPU's id (parallel/device.physical_device_id) in the store and rank 0 picks (`choose_transport`):
- `SAME_GPU`: every receiver computes on the sender's GPU (an engine sharing it): the buffer is
  shared in place (CUDA IPC), no copy; the header and a barrier per bucket go over gloo;
- `BETWEEN_GPUS`: every rank on a GPU of its own: NCCL broadcasts device to device;
- `HOST_MEMORY`: anything else (CPU ranks, or GPUs shared by some ranks only): gloo through host memory.
Joining ends with a one-byte broadcast, checked on the host, so NCCL (which connects at the first
collective) is connected, or fails, at set-up. With `SAME_GPU` every receiver also opens a small
shared tensor then; where CUDA IPC does not work all ranks fall back to `HOST_MEMORY`, and rank 0
says so, as it does when GPUs were allowed but the placement fits neither GPU transport.
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from flexrl_ds.common import notes
from flexrl_ds.parallel import device as device_mod

ALIGN = 16
"""Byte alignment of each tensor in a bucket's buffer (so every slice can be viewed as its dtype)."""

SAME_GPU, BETWEEN_GPUS, HOST_MEMORY = "same_gpu", "between_gpus", "host_memory"
"""The channel's transports (module docstring)."""


def choose_transport(gpu_allowed: bool, device_ids: list[str | None]) -> str:
    """The transport for ranks on these GPUs (device_ids[0]: the sender's; None: a rank without one)."""
    if not gpu_allowed or any(device_id is None for device_id in device_ids):
        return HOST_MEMORY
    if all(device_id == device_ids[0] for device_id in device_ids[1:]):
        return SAME_GPU
    if len(set(device_ids)) == len(device_ids):
        return BETWEEN_GPUS
    return HOST_MEMORY


@dataclass(frozen=True)
class ChannelAddress:
    """Where the channel's store listens (policy rank 0's node), how many ranks join, and over what."""

    host: str
    port: int
    size: int
    """1 (the sender) + the receivers (one per engine worker)."""
    timeout_s: float = 900.0
    use_gpu: bool = False
    """The ranks may use their GPUs (`SAME_GPU` or `BETWEEN_GPUS`, whichever fits where they are);
    False: `HOST_MEMORY`. Set once for all ranks by whoever sets the channel up, never per rank."""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def pack_bucket(bucket: list[tuple[str, torch.Tensor]], device: torch.device) -> tuple[bytes, torch.Tensor]:
    """(header, flat uint8 buffer) of a bucket: tensors at ALIGN-byte offsets, described in the header."""
    meta, offset = [], 0
    for name, tensor in bucket:
        nbytes = tensor.numel() * tensor.element_size()
        meta.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes))
        offset += _aligned(nbytes)
    flat = torch.zeros(offset, dtype=torch.uint8, device=device)
    for (_, tensor), (_, _, _, start, nbytes) in zip(bucket, meta):
        flat[start:start + nbytes] = tensor.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
    return json.dumps(meta).encode(), flat


def _header_entries(header: bytes) -> list:
    """A bucket's header: JSON, not pickle (the store it passes through listens on the network, and
    reading pickle from it could run code)."""
    entries = json.loads(header)
    if not isinstance(entries, list) or not all(isinstance(entry, list) and len(entry) == 5 for entry in entries):
        raise ValueError("weight channel: a bucket header that is not [name, dtype, shape, start, bytes] entries")
    for _, dtype, _, _, _ in entries:
        if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ValueError(f"weight channel: a bucket header names {dtype!r}, not a torch dtype")
    return entries


def unpack_bucket(header: bytes, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The bucket `pack_bucket` described: views into `flat` with each tensor's dtype and shape."""
    bucket = []
    for name, dtype, shape, start, nbytes in _header_entries(header):
        bucket.append((name, flat[start:start + nbytes].view(getattr(torch, dtype)).view(tuple(shape))))
    return bucket


class WeightChannel:
    """One end of the channel: rank 0 sends, ranks 1.. receive (see the module docstring)."""

    def __init__(self, address: ChannelAddress, rank: int, store: dist.TCPStore | None = None):
        """store: the sender's (`worker_group.open_store`, whose port the address names); receivers connect to it."""
        import datetime

        if not 0 <= rank < address.size:
            raise ValueError(f"weight channel: rank {rank} outside a channel of {address.size}")
        self.rank = rank
        if store is None:
            store = dist.TCPStore(address.host, address.port, address.size, is_master=False,
                                  timeout=datetime.timedelta(seconds=address.timeout_s))
        device_mod.pin_collectives(address.host)
        self.transport = self._agree_transport(dist.PrefixStore("flexrl-where", store), address)
        on_gpu = self.transport in (SAME_GPU, BETWEEN_GPUS)
        self.device = device_mod.current_device(device_mod.GPU if on_gpu else device_mod.CPU)
        """Where buckets are packed and received."""
        group_info = device_mod.GPU if self.transport == BETWEEN_GPUS else device_mod.CPU
        self.wire_device = device_mod.current_device(group_info)
        """Where the group's broadcasts live."""
        self.group = device_mod.new_private_group(group_info, dist.PrefixStore("flexrl-weights", store), rank,
                                                  address.size, address.timeout_s)
        self._store = store  # the sender's store must outlive the group's rendezvous
        self.size = address.size
        self._check_connected(rank)
        if self.transport == SAME_GPU:
            self._check_sharing()

    def _agree_transport(self, store, address: ChannelAddress) -> str:
        """Every rank names its GPU; rank 0 chooses the transport for all and every rank reads it."""
        local = device_mod.detect() if address.use_gpu else device_mod.CPU
        store.set(f"rank{self.rank}", device_mod.physical_device_id(local) or "")
        if self.rank == 0:
            device_ids = [store.get(f"rank{rank}").decode() or None for rank in range(address.size)]
            transport = choose_transport(address.use_gpu, device_ids)
            if address.use_gpu and transport == HOST_MEMORY:
                notes.say(f"weight channel: GPUs allowed, but the ranks' GPUs {device_ids} (rank 0 first; None: "
                          f"none) allow neither {SAME_GPU} nor {BETWEEN_GPUS}: buckets go through host memory (slow)")
            store.set("transport", transport)
        return store.get("transport").decode()

    def _check_connected(self, rank: int) -> None:
        """NCCL connects lazily, at the first collective: one here (waited for on the host) makes a
        bad device or network fail at set-up, where every rank is joining, not inside the first
        sync's ZeRO-3 gathers."""
        probe = torch.tensor([1 if rank == 0 else 0], dtype=torch.uint8, device=self.wire_device)
        self._broadcast(probe)
        if int(probe.item()) != 1:
            raise RuntimeError(f"weight channel rank {rank}: the set-up broadcast from rank 0 arrived wrong")

    def _check_sharing(self) -> None:
        """`SAME_GPU`: every receiver opens a small shared tensor now, so a machine where CUDA IPC
        fails (e.g. processes in separate IPC namespaces) is found at set-up; then every rank falls
        back to `HOST_MEMORY` (the group is gloo already)."""
        pattern = torch.arange(ALIGN, dtype=torch.uint8)
        probe = pattern.to(self.device) if self.rank == 0 else None
        opened = self._share_or_open(probe)
        works = True
        if self.rank > 0:
            try:
                works = torch.equal(device_mod.open_shared(opened, self.device).cpu(), pattern)
            except Exception as error:  # noqa: BLE001 - whatever stops the opening, sharing does not work here
                works = False
                notes.say(f"weight channel rank {self.rank}: cannot open rank 0's GPU memory (CUDA IPC): {error}",
                          console=False)  # rank 0 says it once, for all
        verdict = torch.tensor([1.0 if works else 0.0])
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([verdict], options).wait()
        del probe
        device_mod.release_shared(device_mod.GPU)
        if verdict.item() < 1:
            if self.rank == 0:
                notes.say(f"weight channel: a receiver cannot open rank 0's GPU memory (CUDA IPC; the receivers' "
                          f"logs say why): {HOST_MEMORY} instead")
            self.transport, self.device = HOST_MEMORY, device_mod.current_device(device_mod.CPU)

    def _share_or_open(self, flat: torch.Tensor | None) -> tuple | None:
        """`SAME_GPU`: rank 0 sends one handle of `flat` per receiver (torch counts each opener
        against a handle of its own); a receiver returns its handle."""
        if self.rank == 0:
            device_mod.synchronize(device_mod.GPU)  # written before any receiver reads it
            self._header(pickle.dumps([device_mod.share_with_same_device(flat) for _ in range(self.size - 1)]))
            return None
        return pickle.loads(self._header())[self.rank - 1]

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()

    def _barrier(self) -> None:
        """Every rank waits for all (`SAME_GPU`: the receivers have loaded the shared bucket)."""
        self.group.allreduce([torch.zeros(1, device=self.wire_device)]).wait()

    def _header(self, payload: bytes | None = None) -> bytes:
        length = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.int64, device=self.wire_device)
        self._broadcast(length)
        data = torch.zeros(int(length.item()), dtype=torch.uint8, device=self.wire_device)
        if payload:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        if len(data):
            self._broadcast(data)
        return bytes(data.cpu().numpy())

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> int:
        """Rank 0: send every bucket, then the end marker; returns the bytes sent."""
        assert self.rank == 0, "only rank 0 of a weight channel sends"
        sent = 0
        for bucket in buckets:
            header, flat = pack_bucket(bucket, self.device)
            self._header(header)
            if self.transport == SAME_GPU:
                self._share_or_open(flat)
                self._barrier()
            else:
                self._broadcast(flat)
            sent += flat.numel()
            del bucket, flat  # before the next bucket is gathered: one bucket's copy at a time on the device
            if self.transport == SAME_GPU:
                device_mod.release_shared(device_mod.GPU)
        self._header(b"")
        return sent

    def receive(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Ranks 1..: the buckets of one sync, in order, as tensors on this rank's device (`SAME_GPU`:
        views of the sender's memory, to be copied out before the next bucket is asked for)."""
        assert self.rank > 0, "rank 0 of a weight channel sends"
        while True:
            header = self._header()
            if not header:
                return
            if self.transport == SAME_GPU:
                flat = device_mod.open_shared(self._share_or_open(None), self.device)
            else:
                size = sum(_aligned(nbytes) for *_, nbytes in _header_entries(header))
                flat = torch.empty(size, dtype=torch.uint8, device=self.device)
                self._broadcast(flat)
            yield unpack_bucket(header, flat)
            del flat  # loaded: freed before the next bucket's buffer is allocated (the caller drops its views too)
            if self.transport == SAME_GPU:
                device_mod.synchronize(device_mod.GPU)  # copied out before the sender may free it
                self._barrier()

    def load_each(self, load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> int:
        """Ranks 1..: `load` each bucket of one sync as it arrives (its buffer freed before the next
        one is allocated); returns the tensors loaded."""
        count = 0
        for bucket in self.receive():
            load(bucket)
            count += len(bucket)
            del bucket
        return count
