"""Preprocessing actors: decode once per prompt, keep the result per slice in Ray's object store.

- `SliceMaker` (plain class, no Ray): runs `SamplePreprocessor.probe` / `.materialize` and cuts
  each media item's patch rows into slices (`metastore.ItemLayout`): an image is one slice, a
  video one slice per chunk of consecutive temporal patch groups, so a worker that needs frames
  i..j pulls only the chunks covering them.
- `PreprocessActor` (thin Ray actor): wraps a `SliceMaker`; `ray.put`s every slice (pixels as
  numpy arrays, which Ray hands to readers zero-copy: `shippable_slice`), so the
  tensors live in the object store of the actor's node and are owned by the actor, and returns
  only the small `{SliceKey: ObjectRef}` map — or a `DecodeFailure` when a record that probed
  fine fails to decode (corrupt frame data, file gone): never an exception. Workers fetch the
  objects directly. The actor holds
  the refs (its cache) until the controller releases the step. Two concurrency groups keep
  metadata probes from queueing behind long video decodes.
- `PreprocessPool` (controller side): creates K actors per node (fractional `num_cpus`), pinned
  to that node (`actor_nodes`: actor -> Ray node id), routes each prompt to the least-loaded live
  actor, or near the prompt's consumers when told where they are (`routing.LoadTracker` /
  `route_near`, `flexrl.data.pool.locality_slack`), probes records in chunks spread over the
  actors, and retries probes of an actor that died.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import psutil
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from flexrl_ds.loader.config import PoolConfig
from flexrl_ds.loader.metastore import ItemLayout, PromptKey, SliceKey, make_layout
from flexrl_ds.loader.routing import LoadTracker
from flexrl_ds.media.types import BadMediaError

MAX_DECODE_TIMES = 4096
"""Decode timings an actor keeps (oldest dropped first)."""

# Errors meaning "the actor (or the owner of an object) is gone": re-route, do not give up.
LOST_ERRORS = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)


@dataclass(frozen=True)
class DecodeFailure:
    """What a preprocess task returns instead of slices when decoding fails after a good probe."""

    bad: Any
    """The `BadRecord` (record id, reason, stage "materialize")."""


def item_layouts(meta: Any, groups_per_chunk: int) -> tuple[ItemLayout, ...]:
    """Slice layout of every media item of a `SampleMeta`."""
    return tuple(
        make_layout(index, item.kind, item.grid_thw, groups_per_chunk) for index, item in enumerate(meta.items)
    )


def _grid_tuple(grid: Any) -> tuple[int, int, int]:
    values = torch.as_tensor(grid).reshape(-1).tolist()
    assert len(values) == 3, f"grid_thw must hold 3 numbers, got {values}"
    return tuple(int(v) for v in values)  # type: ignore[return-value]


class SliceMaker:
    """Probe records and materialise prompts as slices, with a `SamplePreprocessor` (no Ray)."""

    def __init__(self, make_preprocessor: Callable[[], Any]):
        self.preprocessor = make_preprocessor()
        self.num_decoded = 0
        """Prompts materialised (one decode per prompt, whatever its GRPO group size)."""

    def probe(self, records: Sequence[Any]) -> list[Any]:
        return [self.preprocessor.probe(record) for record in records]

    def make_slices(self, key: PromptKey, meta: Any, layouts: Sequence[ItemLayout]) -> dict[SliceKey, dict]:
        """Decode `meta` once and cut every item into its layout's slices (contiguous copies)."""
        items = self.preprocessor.materialize(meta)
        self.num_decoded += 1
        slices: dict[SliceKey, dict] = {}
        for layout in layouts:
            produced = items[layout.item_index]
            pixels, grid = produced.pixel_values, _grid_tuple(produced.grid_thw)
            if grid != layout.grid_thw or pixels.shape[0] != layout.num_patches:
                raise ValueError(
                    f"record {meta.id!r} item {layout.item_index}: materialised grid {grid} "
                    f"({pixels.shape[0]} rows) differs from the predicted {layout.grid_thw}"
                )
            rows = layout.rows_per_group
            for chunk_index, (start, stop) in enumerate(layout.chunks):
                # clone(): a pickled view would carry the whole item's storage
                slices[SliceKey(key, layout.item_index, chunk_index)] = {
                    "pixel_values": pixels[start * rows : stop * rows].clone(),
                    "grid_thw": (stop - start, layout.grid_thw[1], layout.grid_thw[2]),
                }
        return slices


def shippable_slice(value: dict[str, Any]) -> dict[str, Any]:
    """A slice as it goes into the object store: pixels as a numpy array (same memory).

    Ray stores numpy arrays out of band and a reader on the same node gets a zero-copy view of the
    shared memory; a pickled torch tensor would instead be copied into Python bytes and rebuilt
    under the GIL (measured: ~2.6 s per 230 MB in a worker's prefetch threads, stalling the training
    loop's own thread by up to ~1 s). The Materializer turns the rows it cuts back into tensors."""
    return {**value, "pixel_values": value["pixel_values"].numpy()}


@ray.remote(concurrency_groups={"meta": 1, "decode": 1})
class PreprocessActor:
    """Thin Ray wrapper of `SliceMaker` that keeps slices in the object store."""

    def __init__(self, name: str, make_preprocessor: Callable[[], Any], decode_delay_s: float = 0.0):
        self.name = name
        self.maker = SliceMaker(make_preprocessor)
        self.decode_delay_s = decode_delay_s
        self.cache: dict[PromptKey, dict[SliceKey, ray.ObjectRef]] = {}
        self.cached_bytes: dict[PromptKey, int] = {}
        self.decode_times: dict[PromptKey, tuple[float, float]] = {}
        """(start, end) wall-clock `time.time()` of the latest decodes (benchmarks; bounded)."""

    @ray.method(concurrency_group="meta")
    def probe(self, records: Sequence[Any]) -> list[Any]:
        return self.maker.probe(records)

    @ray.method(concurrency_group="decode")
    def preprocess(self, key: PromptKey, meta: Any,
                   layouts: Sequence[ItemLayout]) -> dict[SliceKey, ray.ObjectRef] | DecodeFailure:
        if self.decode_delay_s:
            time.sleep(self.decode_delay_s)  # tests: widen the window in which an actor can die
        started = time.time()
        try:
            slices = self.maker.make_slices(key, meta, layouts)
        except BadMediaError as error:
            return DecodeFailure(error.bad)
        refs = {slice_key: ray.put(shippable_slice(value)) for slice_key, value in slices.items()}
        if len(self.decode_times) >= MAX_DECODE_TIMES:
            del self.decode_times[next(iter(self.decode_times))]
        self.decode_times[key] = (started, time.time())
        self.cache[key] = refs
        self.cached_bytes[key] = sum(value["pixel_values"].nbytes for value in slices.values())
        return refs

    @ray.method(concurrency_group="meta")
    def decode_log(self) -> dict[PromptKey, tuple[float, float]]:
        return dict(self.decode_times)

    @ray.method(concurrency_group="meta")
    def set_decode_delay(self, seconds: float) -> None:
        self.decode_delay_s = seconds

    @ray.method(concurrency_group="meta")
    def release(self, keys: Sequence[PromptKey]) -> int:
        for key in keys:
            self.cache.pop(key, None)
            self.cached_bytes.pop(key, None)
        return len(self.cache)

    @ray.method(concurrency_group="meta")
    def stats(self) -> dict[str, Any]:
        return {
            "name": self.name, "pid": os.getpid(), "rss": psutil.Process().memory_info().rss,
            "num_decoded": self.maker.num_decoded, "num_cached": len(self.cache),
            "cached_bytes": sum(self.cached_bytes.values()),
            "node_id": ray.get_runtime_context().get_node_id(),
        }


class PreprocessPool:
    """The controller's handle on all preprocessing actors: placement, routing, probing."""

    def __init__(self, make_preprocessor: Callable[[], Any], config: PoolConfig | None = None,
                 decode_delay_s: float = 0.0):
        """`config`: the run's `flexrl.data.pool` (None: its defaults)."""
        self.config = config or PoolConfig()
        self.actors: dict[str, Any] = {}
        self.actor_nodes: dict[str, str] = {}
        """Actor name -> Ray node id (hex) it is pinned to."""
        nodes = sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])
        for node_rank, node_id in enumerate(nodes):
            for local in range(self.config.num_actors_per_node):
                name = f"pre-{node_rank}-{local}"
                self.actor_nodes[name] = node_id
                self.actors[name] = PreprocessActor.options(  # type: ignore[attr-defined]  # a Ray actor class
                    num_cpus=self.config.num_cpus_per_actor,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                ).remote(name, make_preprocessor, decode_delay_s)
        self.tracker = LoadTracker(self.actors, self.actor_nodes, self.config.locality_slack)
        self._pending: dict[Any, tuple[str, float]] = {}  # task ref -> (actor, cost)
        self._probe_turn = 0

    @property
    def alive(self) -> list[str]:
        return self.tracker.alive

    def submit(self, key: PromptKey, meta: Any, layouts: Sequence[ItemLayout], cost: float,
               destinations: dict[str, float] | None = None) -> tuple[str, Any]:
        """Start materialising `key` on the least-loaded live actor, or near `destinations` (node id
        -> weight of the prompt's consumers there; `routing.route_near`); returns (actor, task ref)."""
        self._credit_finished()
        name = self.tracker.assign(cost, destinations)
        ref = self.actors[name].preprocess.remote(key, meta, tuple(layouts))
        self._pending[ref] = (name, cost)
        return name, ref

    lost_errors = LOST_ERRORS
    """Errors of `task_result` meaning the owning actor is gone (re-route)."""

    def task_result(self, task_ref: Any) -> dict[SliceKey, Any] | DecodeFailure:
        """Wait for a preprocess task: its `{SliceKey: ObjectRef}` map or its `DecodeFailure`."""
        return ray.get(task_ref, timeout=self.config.timeout_s)

    def _credit_finished(self) -> None:
        if not self._pending:
            return
        done, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0, fetch_local=False)
        for ref in done:
            name, cost = self._pending.pop(ref)
            self.tracker.finish(name, cost)

    def mark_dead(self, name: str) -> None:
        """Stop routing to `name` (its tasks are re-submitted by the caller)."""
        self.tracker.mark_dead(name)
        for ref, (owner, _) in list(self._pending.items()):
            if owner == name:
                del self._pending[ref]

    def probe(self, records: Sequence[Any]) -> list[Any]:
        """`SamplePreprocessor.probe` of every record, in order, on the actors (never here)."""
        size = self.config.probe_chunk_size
        chunks = [list(records[i : i + size]) for i in range(0, len(records), size)]
        results: list[list[Any] | None] = [None] * len(chunks)
        while any(result is None for result in results):
            todo = [i for i, result in enumerate(results) if result is None]
            refs = {i: self._next_probe_actor().probe.remote(chunks[i]) for i in todo}
            for i, ref in refs.items():
                try:
                    results[i] = ray.get(ref, timeout=self.config.timeout_s)
                except LOST_ERRORS as error:
                    self._find_dead_actors()
                    if not self.tracker.alive:
                        raise RuntimeError(f"every preprocessing actor died; last error: {error}") from error
        return [meta for chunk in results for meta in chunk]

    def _next_probe_actor(self) -> Any:
        alive = self.tracker.alive
        if not alive:
            raise ValueError("no live preprocessing actor to route to")
        name = alive[self._probe_turn % len(alive)]
        self._probe_turn += 1
        return self.actors[name]

    def _find_dead_actors(self) -> None:
        """Ask every live actor for its stats; mark those that fail dead."""
        for name in self.tracker.alive:
            try:
                ray.get(self.actors[name].stats.remote(), timeout=self.config.timeout_s)
            except LOST_ERRORS:
                self.mark_dead(name)

    def release(self, released: dict[str, list[PromptKey]]) -> None:
        """Let actors drop their cached slices (fire and forget; dead owners are skipped)."""
        for name, keys in released.items():
            if name in self.tracker.alive:
                self.actors[name].release.remote(keys)

    def stats(self) -> list[dict[str, Any]]:
        refs = {name: self.actors[name].stats.remote() for name in self.tracker.alive}
        return [ray.get(ref, timeout=self.config.timeout_s) for ref in refs.values()]

    def decode_log(self) -> dict[PromptKey, tuple[float, float]]:
        """(start, end) `time.time()` of each live actor's latest decodes (including putting the
        slices into the object store), by prompt: when each step's pixels were ready."""
        refs = [self.actors[name].decode_log.remote() for name in self.tracker.alive]
        return {key: times for log in ray.get(refs, timeout=self.config.timeout_s) for key, times in log.items()}

    def set_decode_delay(self, seconds: float) -> None:
        """Fault-injection aid: every later decode first sleeps `seconds` (0 turns it off)."""
        ray.get([self.actors[name].set_decode_delay.remote(seconds) for name in self.alive])

    def wait_ready(self) -> None:
        """Block until every actor has started (imports done, preprocessor built)."""
        self.stats()

    def kill(self, name: str, wait: bool = True) -> None:
        """Kill one actor (fault injection for tests and benchmarks); routing learns of it on the
        first failed fetch. `wait`: return only once Ray reports the actor dead."""
        handle = self.actors[name]
        ray.kill(handle, no_restart=True)
        deadline = time.monotonic() + self.config.timeout_s
        while wait and time.monotonic() < deadline:
            try:
                ray.get(handle.stats.remote(), timeout=self.config.timeout_s)
            except LOST_ERRORS:
                return
            time.sleep(0.05)

    def shutdown(self) -> None:
        for handle in self.actors.values():
            ray.kill(handle, no_restart=True)
        self.actors.clear()
