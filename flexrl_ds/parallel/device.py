"""The one place that names accelerators and collective backends.

Everything else asks this module which device, backend and stream type to use, so the same code
runs on CUDA/NCCL (GPU machines) and CPU/gloo (laptops, CI). An architecture test forbids the
backend and accelerator names anywhere else in the package.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from flexrl_ds.parallel import network


@dataclass(frozen=True)
class DeviceInfo:
    """The accelerator this process computes on and the collective backend it uses."""

    kind: str
    """'cuda' or 'cpu' (torch device type)."""
    backend: str
    """torch.distributed backend: 'nccl' or 'gloo'."""
    deepspeed_accelerator: str
    """Value for DS_ACCELERATOR: 'cuda' or 'cpu'."""

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device(self.kind, local_rank) if self.is_gpu else torch.device("cpu")


GPU = DeviceInfo(kind="cuda", backend="nccl", deepspeed_accelerator="cuda")
CPU = DeviceInfo(kind="cpu", backend="gloo", deepspeed_accelerator="cpu")


def detect(force_cpu: bool | None = None) -> DeviceInfo:
    """GPU if CUDA is usable and not disabled (FLEXRL_FORCE_CPU=1 or `force_cpu`), else CPU."""
    if force_cpu is None:
        force_cpu = os.environ.get("FLEXRL_FORCE_CPU", "0") == "1"
    if not force_cpu and torch.cuda.is_available():
        return GPU
    return CPU


def gpu_available() -> bool:
    return torch.cuda.is_available()


def profiler_activities() -> list:
    """What torch.profiler records here: the CPU, and the GPU's kernels where there is one."""
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu_available() else [])


def num_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def set_local_device(info: DeviceInfo, local_rank: int) -> torch.device:
    """Bind this process to its device (GPU: `local_rank`); returns the device."""
    if info.is_gpu:
        torch.cuda.set_device(local_rank)
    return info.device(local_rank)


def configure_deepspeed_accelerator(info: DeviceInfo) -> None:
    """Make DeepSpeed pick the matching accelerator (must run before `import deepspeed`)."""
    os.environ.setdefault("DS_ACCELERATOR", info.deepspeed_accelerator)


def synchronize(info: DeviceInfo) -> None:
    """Wait for queued device work (for timing); a no-op on CPU."""
    if info.is_gpu:
        torch.cuda.synchronize()


def to_device(values: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`values` on `device`. A host tensor goes to a GPU through pinned memory without blocking: a
    blocking host-to-device copy waits for every kernel queued before it. (An already pinned `values`
    is copied from as it is: it must not be written before the copy has run.)"""
    device = torch.device(device)
    if values.device == device:
        return values
    if device.type == "cuda" and values.device.type == "cpu":
        return values.pin_memory().to(device, non_blocking=True)
    return values.to(device)


@functools.lru_cache(maxsize=512)
def constant_on(values: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a `dtype` tensor on `device`, made once per (values, dtype, device) and shared by
    every caller (read it, never write it): a fresh host-to-device copy per call would wait for the
    device's queue to drain, e.g. every layer."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def new_side_stream(info: DeviceInfo):
    """A stream for communication overlapped with compute, or None on CPU (async handles suffice)."""
    return torch.cuda.Stream() if info.is_gpu else None


@contextlib.contextmanager
def on_stream(stream) -> Iterator[None]:
    """Run the body on `stream` (None: the current stream)."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield


def wait_stream(info: DeviceInfo, stream) -> None:
    """Make the current stream wait for `stream` (None: nothing to wait for)."""
    if stream is not None:
        torch.cuda.current_stream().wait_stream(stream)


def max_memory_allocated(info: DeviceInfo) -> int:
    """Peak device memory in bytes (0 on CPU, where host RSS is measured instead)."""
    return torch.cuda.max_memory_allocated() if info.is_gpu else 0


class DeviceUsageMonitor:
    """Peak memory in use on this process's GPU as the driver counts it (total - free, like
    nvidia-smi: every allocator on the device, e.g. a vLLM engine's pool while it is awake, which
    torch's `max_memory_allocated` may keep counting after the engine has slept), sampled every
    `interval_s` on a daemon thread. Inert on CPU (peak 0). Besides the peak since `reset`, it keeps
    one since `start_window` (a part of a phase: a colocated engine's awake time), read by `end_window`.
    used_bytes: what is in use, in place of the GPU's count (the node's host memory, tests); poll:
    sample on a thread."""

    def __init__(self, info: DeviceInfo, interval_s: float = 0.05,
                 used_bytes: Callable[[], int] | None = None, poll: bool = True):
        self._lock = threading.Lock()
        self._peak = 0
        self._window_peak: int | None = None
        self._resets = 0
        self._windows = 0
        if used_bytes is None and info.is_gpu:
            used_bytes = functools.partial(_device_bytes_in_use, torch.cuda.current_device())
        self._used = used_bytes
        """None: inert (a CPU rank)."""
        if self._used is not None and poll:
            threading.Thread(target=self._poll, args=(interval_s,), daemon=True, name="device-usage-monitor").start()

    def _poll(self, interval_s: float) -> None:
        while True:  # a daemon thread: it ends with the process
            time.sleep(interval_s)
            self.sample()

    def sample(self) -> None:
        """Count what is in use now into the peaks (the thread's sample)."""
        if self._used is None:
            return
        resets, windows = self._resets, self._windows
        used = self._used()
        with self._lock:  # a sample taken before a reset (or a window's start) belongs to the old peak
            if resets == self._resets:
                self._peak = max(self._peak, used)
            if windows == self._windows and self._window_peak is not None:
                self._window_peak = max(self._window_peak, used)

    def reset(self) -> None:
        """Start a new peak from what is in use now."""
        if self._used is not None:
            with self._lock:
                self._resets += 1
                self._peak = self._used()

    def start_window(self) -> None:
        """Start a second peak from what is in use now (the phase's goes on)."""
        if self._used is not None:
            with self._lock:
                self._windows += 1
                self._window_peak = self._used()

    def end_window(self) -> int:
        """The peak since `start_window` (0 on CPU, or without a window), and stop keeping it."""
        self.sample()
        with self._lock:
            peak, self._window_peak = self._window_peak, None
        return 0 if peak is None else peak

    def peak_bytes(self) -> int:
        self.sample()
        return self._peak


def _device_bytes_in_use(device: int) -> int:
    free, total = torch.cuda.mem_get_info(device)
    return total - free


def release_cached_memory(info: DeviceInfo) -> None:
    """Return the allocator's cached blocks to the device (after moving a model off it); no-op on CPU."""
    if info.is_gpu:
        torch.cuda.empty_cache()


def allocator_counts(info: DeviceInfo) -> dict[str, int]:
    """torch's device allocator so far: `alloc_retries`, allocations that found no cached block and
    retried after freeing the whole cache (each a synchronising release: memory pressure), and
    `device_mallocs`, its calls to the device's malloc (also the refills after a deliberate
    `release_cached_memory`, e.g. before a colocated engine wakes). Zeros on CPU."""
    if not info.is_gpu:
        return {"alloc_retries": 0, "device_mallocs": 0}
    stats = torch.cuda.memory_stats()
    return {"alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "device_mallocs": int(stats.get("num_device_alloc", 0))}


def reset_peak_memory(info: DeviceInfo) -> None:
    """Start a new peak for `max_memory_allocated` and `pinned_host_bytes` (no-op on CPU)."""
    if info.is_gpu:
        torch.cuda.reset_peak_memory_stats()
        if hasattr(torch.cuda, "reset_peak_host_memory_stats"):
            torch.cuda.reset_peak_host_memory_stats()


def pinned_host_bytes(info: DeviceInfo) -> dict[str, int]:
    """Host memory torch's pinned allocator holds from the driver (blocks in use and cached, each
    rounded up as torch allocated it): `current` and `peak` since `reset_peak_memory` (torch's own
    best-effort peak). What DeepSpeed's pinned optimizer offload and moved-out states take of the
    node's memory. Zeros on CPU or a torch without the statistics."""
    if not info.is_gpu or not hasattr(torch.cuda, "host_memory_stats"):
        return {"current": 0, "peak": 0}
    stats = torch.cuda.host_memory_stats()
    return {"current": int(stats.get("allocated_bytes.current", 0)), "peak": int(stats.get("allocated_bytes.peak", 0))}


def use_full_precision_kernels() -> None:
    """Disable TF32 in GPU matmuls and convolutions (cuDNN defaults to TF32 convolutions, e.g. the
    vision patch embedding), so fp32/fp64 runs are comparable with CPU references. No-op on CPU."""
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def accelerator_name() -> str | None:
    """Name of the local GPU (e.g. "NVIDIA H200"; what shipped calibrations match), None without one."""
    return torch.cuda.get_device_name(0) if gpu_available() else None


def current_device(info: DeviceInfo) -> torch.device:
    """The device this process computes on now (its current GPU, or the CPU)."""
    return torch.device(info.kind, torch.cuda.current_device()) if info.is_gpu else torch.device("cpu")


INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""The variables naming the network interface gloo's and NCCL's sockets listen on."""


def pin_collectives(master_addr: str) -> None:
    """Where a group's rendezvous host is the loopback, its collectives' sockets (gloo's, NCCL's
    bootstrap) listen on the loopback interface too (parallel/network.py): INTERFACE_VARS set to it,
    unless the user set them. Runs before the group is created (both read them then)."""
    if network.is_loopback(master_addr):
        interface = network.loopback_interface()
        for name in INTERFACE_VARS:
            os.environ.setdefault(name, interface)


def new_private_group(info: DeviceInfo, store, rank: int, size: int, timeout_s: float):
    """A process group of `size` ranks outside the default world, rendezvousing through `store`
    (NCCL on GPUs, gloo on CPU): e.g. policy rank 0 with rollout engines that are no policy ranks."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if info.is_gpu:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


# ---- sharing device memory with other processes on the same GPU (CUDA IPC) ----------------------
def physical_device_id(info: DeviceInfo) -> str | None:
    """The UUID of the GPU this process computes on (the same in every process that sees that GPU,
    whatever index CUDA_VISIBLE_DEVICES gives it there), None on CPU."""
    if not info.is_gpu:
        return None
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def share_with_same_device(tensor: torch.Tensor) -> tuple:
    """A picklable handle through which another process on the same GPU opens `tensor`'s memory
    without a copy (torch's CUDA IPC; the sender must keep `tensor` alive until every opener is done)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(tensor)
    return tuple(args)


_SHARED_DEVICE_INDEX = 6
"""Position of the storage's device index in torch's `rebuild_cuda_tensor` arguments: the index the
sender knew the GPU by, replaced by this process's own index for the same GPU."""


def open_shared(handle: tuple, device: torch.device) -> torch.Tensor:
    """The tensor `share_with_same_device` shared, opened on `device` (this process's index of the
    sender's GPU); its memory stays the sender's."""
    import inspect

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    names = list(inspect.signature(rebuild_cuda_tensor).parameters)
    if names[_SHARED_DEVICE_INDEX] != "storage_device":  # a torch that moved it: fail loudly, not on the wrong GPU
        raise RuntimeError(f"torch's rebuild_cuda_tensor takes {names}: no 'storage_device' at {_SHARED_DEVICE_INDEX}")
    args = list(handle)
    args[_SHARED_DEVICE_INDEX] = device.index
    return rebuild_cuda_tensor(*args)


def release_shared(info: DeviceInfo) -> None:
    """Sender: free the memory of shared tensors that every opener has released (no-op on CPU)."""
    if info.is_gpu:
        torch.cuda.ipc_collect()


def device_memory_bytes() -> int | None:
    """Memory of the first GPU this process sees, in bytes, without creating a CUDA context here
    (nvidia-smi; the driver of a run must not take device memory from its ranks); None without GPUs."""
    import subprocess

    if not gpu_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    command = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        lines = subprocess.run(command + (["-i", visible] if visible else []), capture_output=True, text=True,
                               timeout=30, check=True).stdout.split()
        return int(float(lines[0]) * 2**20)  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return torch.cuda.get_device_properties(0).total_memory


def device_total_bytes(info: DeviceInfo) -> int | None:
    """This process's GPU's memory in bytes (a rank, whose CUDA context exists); None on CPU."""
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if info.is_gpu else None
