"""`ProcessWorkerGroup`: a worker group of fresh processes on this host, without Ray.

The third implementation of the worker-group interface of runtime/worker_group.py (beside
`RayWorkerGroup` and `SPMDWorkerGroup`): `num_ranks` processes forked from a forkserver that
imported `preload` once (torch, transformers: not N times in parallel), each building its worker
with `factory(WorkerPlace(rank, ...), **kwargs)` — the rendezvous store hosted here on 127.0.0.1,
`local_rank` = rank. `flexrl logprobs --loader local` runs its ranks on it.

Construction returns at once: the ranks build their workers (join the process group, load the
model) while the caller prepares the first call. `run(Worker.method, *args)` / `run_each(Worker.method,
per_rank)` then call the method (given as itself, not its name: `remote_name`) on every rank and
return the results in rank order. A worker
that fails (in its constructor or in a call), a rank process that dies, or no answer within
`timeout_s` fails the call with a RuntimeError naming the rank (with its traceback); the group is
then stopped (its other ranks may be waiting in a collective) and refuses further calls.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
import traceback
from typing import Any, Callable, Sequence

from flexrl_ds.runtime.worker_group import WorkerPlace, open_store, remote_name

_CONSTRUCT = -1
"""Call id of a rank's report about building its worker (only failures are reported)."""
_POLL_S = 0.5
"""How often a waiting call checks that every rank process is still alive."""


def _serve(place: WorkerPlace, factory: Callable[..., Any], kwargs: dict, calls: Any, results: Any) -> None:
    """One rank process: build the worker, then execute calls until the stop message (None)."""
    try:
        worker = factory(place, **kwargs)
    except BaseException:
        results.put((_CONSTRUCT, place.rank, "error", traceback.format_exc()))
        return
    while (message := calls.get()) is not None:
        call_id, method, args, call_kwargs = message
        try:
            results.put((call_id, place.rank, "ok", getattr(worker, method)(*args, **call_kwargs)))
        except BaseException:
            results.put((call_id, place.rank, "error", traceback.format_exc()))


class ProcessWorkerGroup:
    """`num_ranks` local processes, each holding one worker built by `factory(place, **kwargs)`."""

    def __init__(self, factory: Callable[..., Any], num_ranks: int, kwargs: dict | None = None,
                 name: str = "workers", timeout_s: float = 900.0, preload: Sequence[str] = ()):
        if num_ranks < 1:
            raise ValueError(f"{name}: a worker group needs at least one rank, got {num_ranks}")
        self.name, self.num_ranks, self.timeout_s = name, num_ranks, timeout_s
        self.worker_class = factory if isinstance(factory, type) else None
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(list(preload))
        self._store = open_store("127.0.0.1", num_ranks, timeout_s)  # the ranks' rendezvous, while they live
        port = self._store.port
        self._calls = [context.Queue() for _ in range(num_ranks)]
        self._results = context.Queue()
        self._next_call = 0
        self._broken: str | None = None
        places = [WorkerPlace(rank, num_ranks, "127.0.0.1", port, local_rank=rank, ranks_on_node=num_ranks)
                  for rank in range(num_ranks)]
        self._procs = [context.Process(target=_serve, args=(place, factory, kwargs or {}, calls, self._results),
                                       daemon=True, name=f"{name}-{place.rank}")
                       for place, calls in zip(places, self._calls)]
        for proc in self._procs:
            proc.start()

    def run(self, method: Callable[..., Any], *args, **kwargs) -> list:
        """`method(*args, **kwargs)` on every rank (the same arguments); results in rank order."""
        return self._call(method, [(args, kwargs)] * self.num_ranks)

    def run_each(self, method: Callable[..., Any], per_rank: Sequence[tuple]) -> list:
        """`method(*per_rank[r])` on rank r; results in rank order."""
        assert len(per_rank) == self.num_ranks, (len(per_rank), self.num_ranks)
        return self._call(method, [(tuple(args), {}) for args in per_rank])

    def _call(self, method: Callable[..., Any], per_rank: list[tuple[tuple, dict]]) -> list:
        name = remote_name(self.worker_class, method)
        if self._broken is not None:
            raise RuntimeError(f"{self.name}: the group is stopped ({self._broken})")
        call_id, self._next_call = self._next_call, self._next_call + 1
        for calls, (args, kwargs) in zip(self._calls, per_rank):
            calls.put((call_id, name, args, kwargs))
        try:
            return self._collect(call_id, name)
        except RuntimeError as error:
            self._broken = str(error).splitlines()[0]
            self.shutdown(grace_s=1.0)
            raise

    def _collect(self, call_id: int, method: str) -> list:
        """Every rank's result of call `call_id`, or a RuntimeError naming the first rank that failed."""
        results: dict[int, Any] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(results) < self.num_ranks:
            try:
                got_id, rank, status, payload = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                self._check_alive(method, results)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name}.{method}: no answer from rank(s) "
                                       f"{sorted(set(range(self.num_ranks)) - set(results))} within "
                                       f"{self.timeout_s:.0f} s (a hang or a crash on some rank)") from None
                continue
            if status != "ok":
                what = "building its worker" if got_id == _CONSTRUCT else method
                raise RuntimeError(f"{self.name}.{method} failed on rank {rank} ({what}):\n{payload}")
            if got_id == call_id:
                results[rank] = payload
        return [results[rank] for rank in range(self.num_ranks)]

    def _check_alive(self, method: str, results: dict[int, Any]) -> None:
        for rank, proc in enumerate(self._procs):
            if rank not in results and proc.exitcode is not None:
                raise RuntimeError(f"{self.name}.{method} failed on rank {rank}: its process exited with code "
                                   f"{proc.exitcode}")

    def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop the ranks (they finish the call they are in); kill those still alive after `grace_s`."""
        for proc, calls in zip(self._procs, self._calls):
            if proc.is_alive():
                calls.put(None)
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        if self._broken is None:
            self._broken = "shut down"

    def __enter__(self) -> ProcessWorkerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown(grace_s=30.0 if exc[0] is None else 0.1)
