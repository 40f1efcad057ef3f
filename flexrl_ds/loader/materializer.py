"""Worker-side Materializer: pull exactly the slices this worker needs, ahead of time.

The controller hands each worker a `WorkerAssignment` per step: the placeholders it must fill
(`SliceRequest`: a prompt, a media item, temporal groups [t_start, t_stop)) and, per prompt, a
`PromptSource` — either the reference of the preprocessing task that returns the prompt's
`{SliceKey: ObjectRef}` map (ShadowLoader), or the tensors themselves (centralised baseline).

`prefetch(assignment)` returns at once; background threads resolve the task reference, fetch
only the chunks covering the requested groups straight from the owning actor's object store
(numpy arrays: zero-copy, no unpickling under the GIL) and cut each request's rows exactly into a
tensor of the worker's own (one copy, GIL released). `get(step)` waits for that step (the wait is
the exposed data time) and hands the tensors out, with timings of the background work. If the
owner died (the task or its objects are lost), the Materializer asks `repair` for a fresh source
of that prompt — the controller re-routes it to a live actor — and retries. Bytes pulled from an
actor on another node than this worker's (`PromptSource.owner_node` vs the fetcher's `node_id`)
are counted apart: `MaterializedStep.bytes_cross_node`, the pixels that crossed the network.

Withdrawn prompts. If the re-decode of a prompt fails after the step was handed out, the loader
*withdraws* it (`bad_records.py`: the step's shapes are planned, nothing can take its slot). `get`
still returns the step: every other request's tensors, each exactly once, and the withdrawn
prompts in `MaterializedStep.withdrawn` (prompt -> `BadRecord`: record id and reason), their
requests' `tensors` entries None. Under policy `error` nothing is withdrawn: `get` raises a
ValueError naming the record (the loader's, from `repair`, or `BadMediaError`).

    materializer = Materializer(RayFetcher(), repair=RemoteRepair(service), bad_record_policy="skip")
    materializer.prefetch(assignment)               # returns at once
    out = materializer.get(assignment.step)         # blocks for what is not here yet
    for request, tensors in out.delivered(): ...    # the withdrawn prompts' requests left out
    out.withdrawn_reasons()                         # {record id: reason}
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flexrl_ds.loader.metastore import ItemLayout, PromptKey, SliceKey
from flexrl_ds.media.bad_records import check_policy
from flexrl_ds.media.types import BadMediaError


@dataclass(frozen=True)
class SliceRequest:
    """Pixels a worker needs: temporal groups [t_start, t_stop) of one item of one prompt."""

    prompt: PromptKey
    """The prompt (step, slot)."""
    item_index: int
    """Media item within the prompt."""
    t_start: int = 0
    """First temporal group."""
    t_stop: int | None = None
    """One past the last temporal group; None: to the item's end."""

    @classmethod
    def from_placeholder(cls, prompt: PromptKey, placeholder: Any) -> SliceRequest:
        """Request for what a `TensorPlaceholder` (whole item or group range) stands for."""
        return cls(prompt, placeholder.item_index, placeholder.t_start, placeholder.t_stop)


@dataclass
class PromptSource:
    """Where a worker gets one prompt's slices."""

    key: PromptKey
    """The prompt."""
    layouts: tuple[ItemLayout, ...]
    """Slice layout per media item."""
    generation: int = 1
    """Routing generation of `task_ref` (see MetaStore); repair compares it."""
    task_ref: Any = None
    """Reference to `{SliceKey: ObjectRef}` (ShadowLoader path)."""
    inline: dict[SliceKey, dict] | None = None
    """The slices themselves (centralised path: shipped through the controller)."""
    owner_node: str = ""
    """Ray node id of the actor that owns the slices ("" unknown, or inline)."""


@dataclass
class WorkerAssignment:
    """One worker's data for one step."""

    step: int
    """Loader step."""
    requests: tuple[SliceRequest, ...]
    """What to materialise, in the order the worker will consume it."""
    sources: dict[PromptKey, PromptSource]
    """A source for every prompt named in `requests`."""


@dataclass
class MaterializedStep:
    """What `Materializer.get` hands out for one step."""

    step: int
    """Loader step."""
    tensors: list[dict[str, Any] | None]
    """Per request, in the assignment's request order: {"pixel_values": (rows, patch_dim) tensor,
    "grid_thw": (t, h, w)}; None for every request of a withdrawn prompt (see `withdrawn`)."""
    wait_s: float
    """Seconds `get` blocked: data time the training loop could not hide."""
    bytes_fetched: int
    """Pixel bytes this worker pulled (or received inline) for the step."""
    num_repairs: int
    """Prompts re-fetched after their owner died."""
    bytes_cross_node: int = 0
    """Of `bytes_fetched`, those pulled from an actor on another node than this worker's (both
    nodes known); the rest came from this node's object store (or inline)."""
    timing: dict[str, float] = field(default_factory=dict)
    """Where the step's data time went (see `Materializer.get`): `prefetched_at` / `ready_at`
    (wall-clock `time.time()` when `prefetch` was called / the last prompt was cut); summed over
    prompts: `task_wait_s` (waiting for the preprocess task's slice map), `pull_s` (pulling the
    slices from the object store and deserialising them), `cut_s` (cutting the requested rows).
    Background-thread time, not the caller's."""
    requests: tuple[SliceRequest, ...] = ()
    """The assignment's requests (`tensors[i]` is for `requests[i]`)."""
    withdrawn: dict[PromptKey, Any] = field(default_factory=dict)
    """Prompts withdrawn after hand-out (re-decode failed; `bad_records.py`) -> their `BadRecord`
    (`.id`: the record, `.reason`). Empty unless a decode failed after hand-out."""

    def delivered(self) -> list[tuple[SliceRequest, dict[str, Any]]]:
        """(request, tensors) of every request whose prompt was not withdrawn, in request order."""
        return [(request, tensors) for request, tensors in zip(self.requests, self.tensors)
                if request.prompt not in self.withdrawn]

    def withdrawn_reasons(self) -> dict[str, str]:
        """Record id -> reason, for the withdrawn prompts. The id is the record that failed to
        decode: for a substitute standing in under policy replace (sample id `a->b`) that is `b`,
        while the loader's `LoaderStep.withdrawn` names the sample (`a->b`)."""
        return {bad.id: bad.reason for bad in self.withdrawn.values()}


class RayFetcher:
    """`ray.get` with a timeout; names the errors that mean "owner gone, re-route"."""

    def __init__(self, timeout_s: float = 600.0):
        import ray  # lazy: a rank fed inline (centralised baseline) runs without Ray

        self._ray = ray
        self.timeout_s = timeout_s
        self.lost_errors = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)
        self.node_id = ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""
        """This process's Ray node id ("" outside Ray)."""

    def get(self, refs: Sequence[Any]) -> list[Any]:
        return self._ray.get(list(refs), timeout=self.timeout_s)


def chunk_keys_for(source: PromptSource, requests: Sequence[SliceRequest]) -> list[SliceKey]:
    """The cached slices covering `requests` (each once, in order)."""
    keys: dict[SliceKey, None] = {}
    for request in requests:
        layout = source.layouts[request.item_index]
        stop = layout.grid_thw[0] if request.t_stop is None else request.t_stop
        for chunk in layout.chunks_for(request.t_start, stop):
            keys[SliceKey(source.key, request.item_index, chunk)] = None
    return list(keys)


def cut_request(layout: ItemLayout, request: SliceRequest, slices: dict[SliceKey, dict]) -> dict[str, Any]:
    """Rows of exactly groups [t_start, t_stop) from the chunks that cover them."""
    stop = layout.grid_thw[0] if request.t_stop is None else request.t_stop
    chunks = layout.chunks_for(request.t_start, stop)
    per_group = layout.rows_per_group
    pieces = []
    for chunk in chunks:
        chunk_start, chunk_stop = layout.chunks[chunk]
        lo, hi = max(request.t_start, chunk_start), min(stop, chunk_stop)
        rows = slices[SliceKey(request.prompt, request.item_index, chunk)]["pixel_values"]
        pieces.append(rows[(lo - chunk_start) * per_group : (hi - chunk_start) * per_group])
    return {"pixel_values": owned_rows(pieces),
            "grid_thw": (stop - request.t_start, layout.grid_thw[1], layout.grid_thw[2])}


def owned_rows(pieces: Sequence[Any]) -> torch.Tensor:
    """The pieces stacked row-wise into one tensor this process owns.

    numpy pieces are read-only zero-copy views of Ray's shared object store (see
    `actors.shippable_slice`): they are copied exactly once, by numpy with the GIL released (the
    copy frees the store's object and gives a writable tensor). Tensor pieces (the centralised
    path's, already unpickled into this process) are used as they are when there is one."""
    if isinstance(pieces[0], np.ndarray):
        return torch.from_numpy(np.concatenate(pieces))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


@dataclass
class _PromptResult:
    cut: dict[SliceRequest, dict[str, Any]]
    num_bytes: int
    seconds: dict[str, float]
    ready_at: float
    cross_node: bool = False
    """The slices came from an actor on another node."""
    withdrawn: Any = None
    """The prompt's `BadRecord` when its decode failed after hand-out (then `cut` is empty)."""


class _DecodeFailed(Exception):
    """Internal: the prompt's preprocess task returned an `actors.DecodeFailure`."""

    def __init__(self, bad: Any):
        super().__init__(bad)
        self.bad = bad


@dataclass
class _PendingStep:
    assignment: WorkerAssignment
    futures: dict[PromptKey, Future]
    repairs: list[int] = field(default_factory=list)
    prefetched_at: float = 0.0


class Materializer:
    """Fetch a worker's slices for upcoming steps in the background; hand them out per step."""

    def __init__(self, fetcher: Any = None, repair: Callable[[PromptKey, int], PromptSource] | None = None,
                 num_threads: int = 4, max_attempts: int = 3, bad_record_policy: str = "skip"):
        """`bad_record_policy`: the run's `flexrl.data.bad_record_policy` (the loader's). skip /
        replace: a prompt whose decode failed after hand-out comes back withdrawn; error: `get`
        raises `BadMediaError` naming the record."""
        self.fetcher = fetcher if fetcher is not None else RayFetcher()
        self.repair = repair
        self.max_attempts = max_attempts
        self.bad_record_policy = check_policy(bad_record_policy, where="bad_record_policy")
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="materializer")
        self._steps: dict[int, _PendingStep] = {}
        self._lock = threading.Lock()

    def prefetch(self, assignment: WorkerAssignment) -> None:
        """Start fetching `assignment`'s slices; returns immediately."""
        by_prompt: dict[PromptKey, list[SliceRequest]] = {}
        for request in assignment.requests:
            if request.prompt not in assignment.sources:
                raise ValueError(f"step {assignment.step}: no source for prompt {request.prompt}")
            by_prompt.setdefault(request.prompt, []).append(request)
        pending = _PendingStep(assignment, {}, prefetched_at=time.time())
        for key, requests in by_prompt.items():
            source = assignment.sources[key]
            pending.futures[key] = self._pool.submit(self._materialize_prompt, source, requests, pending.repairs)
        with self._lock:
            assert assignment.step not in self._steps, f"step {assignment.step} prefetched twice"
            self._steps[assignment.step] = pending

    def get(self, step: int) -> MaterializedStep:
        """Block until `step`'s slices are here; returns them in request order, withdrawn prompts
        marked (see the module docstring). Raises under policy `error`, or when an owner stays lost
        after `max_attempts` (or with no `repair`)."""
        with self._lock:
            pending = self._steps.pop(step, None)
        if pending is None:
            raise KeyError(f"step {step} was never prefetched on this worker")
        started = time.perf_counter()
        done = {key: future.result() for key, future in pending.futures.items()}
        wait_s = time.perf_counter() - started
        requests = pending.assignment.requests
        withdrawn = {key: d.withdrawn for key, d in done.items() if d.withdrawn is not None}
        tensors = [None if request.prompt in withdrawn else done[request.prompt].cut[request] for request in requests]
        timing = {
            "prefetched_at": pending.prefetched_at,
            "ready_at": max((d.ready_at for d in done.values()), default=pending.prefetched_at),
            **{name: sum(d.seconds[name] for d in done.values()) for name in ("task_wait_s", "pull_s", "cut_s")},
        }
        num_bytes = sum(d.num_bytes for d in done.values())
        cross_bytes = sum(d.num_bytes for d in done.values() if d.cross_node)
        return MaterializedStep(step, tensors, wait_s, num_bytes, len(pending.repairs), cross_bytes, timing,
                                requests=tuple(requests), withdrawn=withdrawn)

    def _materialize_prompt(self, source: PromptSource, requests: list[SliceRequest],
                            repairs: list[int]) -> _PromptResult:
        """Fetch, then cut every request of one prompt (in the background thread, so `get` only
        hands out finished tensors). A decode failure: the prompt comes back withdrawn (policy
        skip/replace) or `BadMediaError` (policy error)."""
        seconds = {"task_wait_s": 0.0, "pull_s": 0.0}
        try:
            slices, source = self._fetch_prompt(source, requests, repairs, seconds)
        except _DecodeFailed as failed:
            if self.bad_record_policy == "error":
                raise BadMediaError(failed.bad) from None
            return _PromptResult({}, 0, {**seconds, "cut_s": 0.0}, time.time(), withdrawn=failed.bad)
        fetched = time.perf_counter()
        cut = {request: cut_request(source.layouts[request.item_index], request, slices) for request in requests}
        seconds["cut_s"] = time.perf_counter() - fetched
        num_bytes = sum(value["pixel_values"].nbytes for value in slices.values())
        here = getattr(self.fetcher, "node_id", "")
        cross_node = bool(here and source.owner_node and source.owner_node != here)
        return _PromptResult(cut, num_bytes, seconds, time.time(), cross_node)

    def _fetch_prompt(self, source: PromptSource, requests: list[SliceRequest], repairs: list[int],
                      seconds: dict[str, float]):
        for attempt in range(self.max_attempts):
            keys = chunk_keys_for(source, requests)
            if source.inline is not None:
                return {key: source.inline[key] for key in keys}, source
            try:
                started = time.perf_counter()
                (slice_refs,) = self.fetcher.get([source.task_ref])
                pulling = time.perf_counter()
                seconds["task_wait_s"] += pulling - started
                if hasattr(slice_refs, "bad"):  # actors.DecodeFailure: only after hand-out (re-decode)
                    raise _DecodeFailed(slice_refs.bad)
                values = self.fetcher.get([slice_refs[key] for key in keys])
                seconds["pull_s"] += time.perf_counter() - pulling
                return dict(zip(keys, values)), source
            except self.fetcher.lost_errors:
                if self.repair is None or attempt + 1 == self.max_attempts:
                    raise
                source = self.repair(source.key, source.generation)
                repairs.append(1)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
