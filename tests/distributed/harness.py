"""A small reusable process pool for multi-rank tests (gloo on CPU).

`DistPool(world_size)` spawns N processes ONCE, each joining one gloo job (and deepspeed.comm with
`with_deepspeed=True`); `pool.run(fn, *args)` runs the top-level function `fn` on every rank and returns
the per-rank results (rank order). A rank's exception is re-raised in the test with every failing
rank's traceback; a hang becomes a `TimeoutError` after `timeout_s`, and the pool is torn down (the
next `run` starts a fresh one). Tensors travel back as numpy arrays and are turned into tensors again.

Inside `fn`, `worker_state()` is a per-process dict that lives as long as the pool (e.g. to build a
`GroupTree` once per topology with `cached_group_tree`).

The job's rendezvous store is opened by the pool itself on a port the OS picks, before any rank
starts, and held while the pool lives; every rank joins it as a client (torch's
`TORCHELASTIC_USE_AGENT_STORE`, the launcher-hosted store of torchrun), so no other process can take
the port between its choice and its bind.
"""

from __future__ import annotations

import contextlib
import importlib.util
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

_STATE: dict[str, Any] = {}


def worker_state() -> dict[str, Any]:
    """Per-rank state that survives between `run` calls of the same pool."""
    return _STATE


def cached_group_tree(domain_size: int, p_max: int):
    """This rank's GroupTree for (domain_size, p_max), created once per pool (collective on first use)."""
    import torch.distributed as dist

    from flexrl_ds.parallel.group_tree import GroupTree, SPTopology

    key = ("group_tree", domain_size, p_max)
    if key not in _STATE:
        topology = SPTopology(world_size=dist.get_world_size(), domain_size=domain_size, p_max=p_max)
        _STATE[key] = GroupTree.create(topology, dist.get_rank())
    return _STATE[key]


def _to_wire(value):
    import torch

    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype in (torch.bfloat16, torch.float16):  # numpy has no bfloat16; float32 is exact
            value = value.float()
        return ("__tensor__", value.numpy())
    if isinstance(value, (list, tuple)):
        return type(value)(_to_wire(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def _from_wire(value):
    if isinstance(value, tuple) and len(value) == 2 and value[0] == "__tensor__":
        import torch

        return torch.from_numpy(value[1])
    if isinstance(value, (list, tuple)):
        return type(value)(_from_wire(v) for v in value)
    if isinstance(value, dict):
        return {k: _from_wire(v) for k, v in value.items()}
    return value


def _load_function(path: str, name: str) -> Callable:
    module_name = "_dist_task_" + Path(path).stem
    module = sys.modules.get(module_name)
    if module is None:
        sys.path.insert(0, str(Path(path).parent))
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return getattr(module, name)


def _worker(rank: int, world_size: int, port: int, with_deepspeed: bool, use_gpu: bool, tasks, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      TORCHELASTIC_USE_AGENT_STORE="True",  # the pool hosts the store: join it as a client
                      FLEXRL_FORCE_CPU="0" if use_gpu else "1")
    from flexrl_ds.parallel import device

    os.environ["DS_ACCELERATOR"] = (device.GPU if use_gpu else device.CPU).deepspeed_accelerator
    try:
        import torch

        torch.set_num_threads(1)
        from flexrl_ds.parallel.launch import init_distributed

        _STATE["context"] = init_distributed(timeout_s=600, with_deepspeed=with_deepspeed)
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE")  # only this job's store is the pool's
        results.put((rank, "ready", None))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        return
    while True:
        task = tasks.get()
        if task is None:
            break
        path, name, args, kwargs = task
        try:
            value = _load_function(path, name)(*args, **kwargs)
            results.put((rank, "ok", _to_wire(value)))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))


# Ranks fork from one forkserver that imported torch (and DeepSpeed) once: a fresh, thread-free
# process per rank without paying the imports N times on a 2-core machine.
_PRELOAD = ["torch", "torch.distributed", "flexrl_ds.parallel.launch", "flexrl_ds.sp.attention",
            "flexrl_ds.sp.fixed_sp", "deepspeed.comm", "deepspeed.sequence.layer"]


def _context():
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


class DistPool:
    """N gloo ranks in spawned processes, reused across tests."""

    def __init__(self, world_size: int, with_deepspeed: bool = False, use_gpu: bool = False,
                 start_timeout_s: float = 180.0):
        """with_deepspeed: wrap the job in deepspeed.comm (DeepSpeed's primitives usable; slower start).
        use_gpu: one GPU per rank and the GPU backend (tests/gpu); default CPU + gloo."""
        self.world_size = world_size
        self.with_deepspeed = with_deepspeed
        self.use_gpu = use_gpu
        self.start_timeout_s = start_timeout_s
        self._procs: list = []
        self._tasks: list = []
        self._results = None
        self._store = None

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        from flexrl_ds.parallel import device
        from flexrl_ds.runtime.worker_group import open_store

        if self.use_gpu:  # the forkserver preloads deepspeed.comm, which picks its accelerator from the
            # environment it starts with (tests/conftest.py defaults it to the CPU one)
            os.environ["DS_ACCELERATOR"] = device.GPU.deepspeed_accelerator
        context = _context()
        self._store = open_store("127.0.0.1", self.world_size, timeout_s=600)
        port = self._store.port
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(self.world_size)]
        self._procs = [
            context.Process(target=_worker, daemon=True,
                            args=(r, self.world_size, port, self.with_deepspeed, self.use_gpu, self._tasks[r], self._results))
            for r in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._collect(self.start_timeout_s, what="start-up")

    def run(self, fn: Callable, *args, timeout_s: float = 120.0, **kwargs) -> list:
        """Run top-level `fn(*args, **kwargs)` on every rank; per-rank results in rank order."""
        if not self.alive:
            self.close()
            self.start()
        path = str(Path(sys.modules[fn.__module__].__file__).resolve())
        for task_queue in self._tasks:
            task_queue.put((path, fn.__name__, args, kwargs))
        return self._collect(timeout_s, what=fn.__name__)

    def _collect(self, timeout_s: float, what: str) -> list:
        deadline = time.monotonic() + timeout_s
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(values) + len(errors) < self.world_size:
            try:
                rank, status, payload = self._results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                if time.monotonic() < deadline and self.alive:
                    continue
                missing = sorted(set(range(self.world_size)) - set(values) - set(errors))
                self.close()
                raise TimeoutError(f"{what}: ranks {missing} did not finish within {timeout_s:.0f} s "
                                   f"(hang or crash); pool torn down. Errors so far: {errors}") from None
            if status == "error":
                errors[rank] = payload
            else:
                values[rank] = _from_wire(payload)
        if errors:
            text = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            raise RankError(f"{what} failed on ranks {sorted(errors)}:\n{text}", errors)
        return [values[r] for r in range(self.world_size)]

    def close(self, grace_s: float = 3.0) -> None:
        for task_queue in self._tasks:
            try:
                task_queue.put(None)
            except Exception:
                pass
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs, self._tasks, self._store = [], [], None


class RankError(RuntimeError):
    """One or more ranks raised; `.errors` maps rank -> traceback text."""

    def __init__(self, message: str, errors: dict[int, str]):
        super().__init__(message)
        self.errors = errors


@contextlib.contextmanager
def gpu_pool(world_size: int, with_deepspeed: bool = True):
    """A started pool of `world_size` ranks with one GPU each (tests/gpu), closed on exit; the test is
    skipped where the machine has fewer GPUs."""
    import pytest

    from flexrl_ds.parallel import device

    if device.num_gpus() < world_size:
        pytest.skip(f"needs {world_size} GPU(s)")
    pool = DistPool(world_size, with_deepspeed=with_deepspeed, use_gpu=True)
    pool.start()
    try:
        yield pool
    finally:
        pool.close()
