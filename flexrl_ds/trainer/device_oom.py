"""A device out-of-memory error inside a phase of a step, said in one line.

torch's `OutOfMemoryError` (and vLLM's "CUDA Error: out of memory", a RuntimeError from its own
allocator, e.g. in `wake_up`) raised inside a policy rank's phase becomes a `DeviceOutOfMemory`: a
`RunInputError` (so `flexrl` prints it as one line, cli/main.py; FLEXRL_DEBUG=1 shows the traceback)
naming the rank, the phase, the phase's peak device memory and the device's, and the settings that
take memory off that phase. The driver gets it from Ray as the rank raised it
(runtime/lost_workers.py `ray_get_explained` unwraps a worker's `RunInputError`).
`flexrl estimate-memory` (trainer/memory_estimate.py) gives the phase's terms before a run starts.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch

from flexrl_ds.common import RunInputError
from flexrl_ds.parallel import device as device_mod

PHASE_SETTINGS = {
    "rollout": ("flexrl.rollout.vllm.gpu_memory_utilization (lower), flexrl.trainer.offload_states_in_rollout "
                "(true) or flexrl.trainer.reference_offload_param (true)"),
    "logprobs": ("flexrl.sp.logprob_max_tokens_per_rank / max_tokens_per_rank (lower), flexrl.sp.logprob_chunk_bytes "
                 "(lower) or flexrl.trainer.reference_offload_param (true)"),
    "update": ("flexrl.trainer.activation_checkpointing (true), flexrl.sp.max_tokens_per_rank (lower) or "
               "zero_optimization.offload_optimizer (a higher ratio)"),
    "sync": ("flexrl.trainer.weight_sync_bucket_mb (lower), zero_optimization.offload_optimizer (a higher ratio) or "
             "flexrl.trainer.reference_offload_param (true)"),
}
"""Per phase, the settings that take device memory off it."""


class DeviceOutOfMemory(RunInputError, RuntimeError):
    """The device ran out of memory in a phase; the message names it, its peak and what to change.
    A RuntimeError too, as the error it replaces was."""


def is_device_oom(error: BaseException) -> bool:
    """torch's out-of-memory error, or an allocator's RuntimeError saying "out of memory" (vLLM's)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


def oom_line(phase: str, rank: int, peak_bytes: int, total_bytes: int | None, error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [type(error).__name__])[0][:160]
    device = f" of the device's {total_bytes / 2**30:.1f} GiB" if total_bytes else ""
    return (f"rank {rank}: out of device memory in the {phase} phase (peak {peak_bytes / 2**30:.1f} GiB "
            f"in use{device}; {first}). Change {PHASE_SETTINGS.get(phase, 'the batch')}; "
            "`flexrl estimate-memory` shows the phase's terms")


@contextlib.contextmanager
def naming_device_oom(phase: str, rank: int, peak_bytes: Callable[[], int],
                      total_bytes: Callable[[], int | None]) -> Iterator[None]:
    """Turn a device OOM raised inside into a `DeviceOutOfMemory` (other errors pass unchanged)."""
    try:
        yield
    except Exception as error:
        if not is_device_oom(error):
            raise
        raise DeviceOutOfMemory(oom_line(phase, rank, peak_bytes(), total_bytes(), error)) from error


def _phase_peak_bytes(rank) -> int:
    """The phase's peak device memory in use (every allocator), or torch's where higher."""
    usage = getattr(rank, "device_usage", None)
    return max(usage.peak_bytes() if usage is not None else 0, device_mod.max_memory_allocated(rank.device_info))


def phase(name: str):
    """A policy rank's phase method: a device out-of-memory error inside it ends the run with one line
    naming the phase, its peak and the settings to change (`naming_device_oom`)."""
    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kwargs):
            with naming_device_oom(name, self.rank, functools.partial(_phase_peak_bytes, self),
                                   lambda: device_mod.device_total_bytes(self.device_info)):
                return method(self, *args, **kwargs)
        return run
    return wrap
