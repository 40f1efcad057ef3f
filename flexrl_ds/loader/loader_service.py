"""ShadowLoader's controller side as a Ray actor, so that workers in other processes can repair.

`ProxyLoader.repair(prompt, generation)` decides, once, what happens to a prompt whose owner died
(re-route) and to a prompt whose re-decode then fails (withdrawn by the bad-record policy,
`bad_records.py`). A bound method of a loader in the driver process cannot be called from a
worker process, so in a multi-process job the loader runs inside `LoaderService` (a thin Ray
actor around a plain `ProxyLoader` and its `PreprocessPool`) and workers hand their Materializer
a `RemoteRepair(service)`: the decision is still taken in one place, whichever process finds the
failure. The driver calls the same methods remotely (`next_step`, `assignment`, `release`); the
`LoaderStep` it receives is a snapshot, `report(step)` includes withdrawals found after hand-out.

    service = LoaderService.options(max_concurrency=8).remote(records, make_preprocessor, data_config)
    step = ray.get(service.next_step.remote())
    assignment = ray.get(service.assignment.remote(step.step, requests))     # to a worker
    Materializer(RayFetcher(), repair=RemoteRepair(service),                  # on the worker
                 bad_record_policy=data_config.bad_record_policy)

A prompt withdrawn after hand-out reaches the worker as `MaterializedStep.withdrawn` (the other
prompts' tensors intact), and the driver sees it in `report(step)["withdrawn"]`.

With `flexrl.data.loading` "central" the service holds a `CentralLoader` instead (no pool): it
probes and decodes each step inside `next_step`, while the driver waits, and its assignments carry
the pixel tensors themselves (the veRL-style baseline, the same samples as ShadowLoader's).
"""

from __future__ import annotations

import resource
from collections.abc import Callable, Sequence
from typing import Any

import ray

from flexrl_ds.loader.actors import PreprocessPool
from flexrl_ds.loader.central_loader import CentralLoader
from flexrl_ds.loader.config import DataConfig
from flexrl_ds.loader.materializer import PromptSource, SliceRequest, WorkerAssignment
from flexrl_ds.loader.metastore import PromptKey
from flexrl_ds.loader.proxy_loader import ProxyLoader


@ray.remote
class LoaderService:
    """Thin Ray actor around `ProxyLoader` + `PreprocessPool`; start it with `max_concurrency` > 1
    so repairs from workers are served while `next_step` waits for decodes."""

    def __init__(self, records: Sequence[Any], make_preprocessor: Callable[[], Any], data_config: DataConfig):
        """`data_config`: the run's `flexrl.data`; its `pool`, `loader`, `bad_record_policy` and
        `loading` are used ("central": a `CentralLoader` decoding here, no pool)."""
        self.pool: PreprocessPool | None = None
        self.loader: CentralLoader | ProxyLoader
        if data_config.loading == "central":
            self.loader = CentralLoader(records, make_preprocessor, data_config.loader, data_config.bad_record_policy)
        else:
            self.pool = PreprocessPool(make_preprocessor, data_config.pool)
            self.loader = ProxyLoader(records, self.pool, data_config.loader, data_config.bad_record_policy)
        self._steps: dict[int, Any] = {}

    def wait_ready(self) -> None:
        if self.pool is not None:
            self.pool.wait_ready()

    def peak_rss_bytes(self) -> int:
        """This process's peak resident memory so far (the central loader holds a step's pixels here)."""
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB

    def skip_steps(self, num_steps: int) -> None:
        self.loader.skip_steps(num_steps)

    def next_step(self) -> Any:
        step = self.loader.next_step()
        self._steps[step.step] = step
        return step

    def assignment(self, step: int, requests: Sequence[SliceRequest], consumer_node: str = "") -> WorkerAssignment:
        """`consumer_node`: the asking worker's Ray node id (where later decodes are routed; the
        central loader ships the tensors themselves)."""
        if isinstance(self.loader, CentralLoader):
            return self.loader.assignment(self._steps[step], requests)
        return self.loader.assignment(self._steps[step], requests, consumer_node)

    def repair(self, key: PromptKey, failed_generation: int) -> PromptSource:
        return self.loader.repair(key, failed_generation)

    def report(self, step: int) -> dict[str, Any]:
        """The step's current report (withdrawals found after hand-out included)."""
        return self._steps[step].report()

    def stats(self) -> dict[str, Any]:
        return self.loader.stats.as_dict()

    def owner_of(self, key: PromptKey) -> str:
        if not isinstance(self.loader, ProxyLoader):
            raise ValueError("owner_of: central loading keeps no preprocessing actors (flexrl.data.loading)")
        return self.loader.store.entry(key).owner

    def kill_preprocess_actor(self, name: str) -> None:
        """Fault injection (tests, benchmarks)."""
        if self.pool is None:
            raise ValueError("kill_preprocess_actor: central loading keeps no preprocessing actors")
        self.pool.kill(name)

    def release(self, step: int) -> None:
        self.loader.release(self._steps.pop(step))

    def shutdown(self) -> None:
        if self.pool is not None and isinstance(self.loader, ProxyLoader):
            self.loader.close()
            self.pool.shutdown()


class RemoteRepair:
    """Picklable `repair` callable for a worker's Materializer: asks a `LoaderService`. The
    loader's ValueError (policy `error`: a record whose re-decode failed, named) is raised here as
    itself, not wrapped in Ray's task error."""

    def __init__(self, service: Any, timeout_s: float = 600.0):
        self.service, self.timeout_s = service, timeout_s

    def __call__(self, key: PromptKey, failed_generation: int) -> PromptSource:
        try:
            return ray.get(self.service.repair.remote(key, failed_generation), timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, ValueError):
                raise error.cause from None
            raise
