"""ProxyLoader: the controller's data loader that never touches pixels.

Each `next_step()` returns a `LoaderStep`: B prompts (global batch) chosen in a seeded order, their
`SampleMeta` (probed on the preprocessing actors) with shape-only placeholders, the ids of the
B*n GRPO samples, and the step's bad-record report. Composing a step (probing its rows on the
actors, applying the policy, dispatching its decodes) runs in a background thread: when step k is
returned, steps k+1..k+`lookahead_steps` are being composed and decoded, so neither probing nor
decoding sits on the training loop. Before returning step k, `next_step` waits for step k's
decode tasks (dispatched one call earlier, so normally finished) and applies the bad-record policy
to records that probed fine but failed to decode: the step handed out is final.

`assignment(step, requests, consumer_node)` builds what one worker needs
(`materializer.WorkerAssignment`): references only, each prompt's source naming its owner's node
(the Materializer counts the bytes it pulls across nodes). Decode tasks go to actors near where
the pixels will be used (`routing.route_near`; what is knowable at dispatch time is discussed
there): `destinations(key)` when the caller knows its dealing rule, else the nodes that have
asked for pixels so far (`consumer_node` of each `assignment`), weighted by the rows they asked
for. `repair(prompt, generation)` re-routes the prompts of a dead actor to live ones
(idempotent: concurrent repairs of one failure re-route once) and is what Materializers call; in a
multi-process job workers reach it through `loader_service.LoaderService` / `RemoteRepair`.

Order and bad records: one policy for this loader, the centralised baseline (which shares
`StepSource`) and the offline tools (`dataset.py`), implemented once in `bad_records.py` (see its
docstring) and set by `flexrl.data.bad_record_policy`. In short: epoch e visits every row once in
a permutation seeded by (seed, e), step s takes the next B positions; `skip` drops a bad row's
slot, `replace` fills it with a row reserved from the epoch's tail (`<bad>-><substitute>`,
`LoaderStep.replacements`), `error` raises naming the record; `LoaderStep.bad_records` lists every
bad row, `LoaderStats` counts them.
- Decode failures (stage "materialize": a corrupt frame after a good header, a file gone between
  probe and decode) found before hand-out get the same policy in the same slot: skip drops the
  prompt (its slot number stays unused), replace decodes a substitute from the epoch's tail into
  that slot. `next_step` re-routes lost decode tasks until a live actor answers, so no step is
  handed out with an unknown outcome.
- A decode failure found after hand-out (owner died, re-decode elsewhere failed) is found by
  `repair`, which waits for the re-decode of a handed-out step's prompt: the prompt is withdrawn
  (`LoaderStep.withdrawn`, `bad_records`, `LoaderStats.num_withdrawn`; ValueError under `error`),
  once, whichever worker asked; `Materializer.get` then returns the step with that prompt marked in
  `MaterializedStep.withdrawn` (every other prompt delivered), and raises naming the record only
  under `error`.
"""

from __future__ import annotations

import io
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray

from flexrl_ds.loader.actors import DecodeFailure, item_layouts
from flexrl_ds.loader.config import LoaderConfig
from flexrl_ds.loader.materializer import PromptSource, SliceRequest, WorkerAssignment
from flexrl_ds.loader.metastore import MetaStore, PromptEntry, PromptKey, SampleId
from flexrl_ds.media.bad_records import BadRecordCounts, BadRecordPolicy, EpochOrder, StepReport, is_bad

@dataclass
class StepPrompt:
    key: PromptKey
    """(step, slot) of the prompt."""
    meta: Any
    """Its `SampleMeta` (metadata and predicted shapes; no pixels)."""

    def placeholders(self) -> list[Any]:
        return self.meta.placeholders()


@dataclass
class LoaderStep:
    step: int
    """Step index (0-based)."""
    epoch: int
    """Epoch the step's rows come from."""
    prompts: list[StepPrompt]
    """The prompts trained on, in slot order."""
    num_samples_per_prompt: int
    """GRPO group size n."""
    bad_records: list[Any] = field(default_factory=list)
    """Every bad row met while composing the step (`BadRecord`s)."""
    replacements: dict[str, str] = field(default_factory=dict)
    """Bad record id -> id of the record that stood in for it (policy replace)."""
    withdrawn: dict[str, str] = field(default_factory=dict)
    """Sample id -> reason for prompts withdrawn after hand-out (decode failed on re-routing):
    not trained on; their slot stays in `prompts` because the step's shapes were planned."""
    rows: list[int] = field(default_factory=list)
    """Dataset rows the step drew (window, then reserved substitutes): never reserved again for it."""
    fates: list[str] = field(default_factory=list)
    """What became of each bad record, aligned with `bad_records` (media/bad_records.py FATE_*)."""

    @property
    def bad_report(self) -> StepReport:
        """This step's lists as a `bad_records.StepReport` (shared, not copied)."""
        return StepReport(self.bad_records, self.replacements, self.withdrawn, self.rows, self.fates)

    def sample_ids(self) -> list[SampleId]:
        return [SampleId(p.key.step, p.key.slot, k) for p in self.prompts for k in range(self.num_samples_per_prompt)]

    def report(self) -> dict[str, Any]:
        return {
            "step": self.step, "epoch": self.epoch, "prompts": [p.meta.id for p in self.prompts],
            "num_bad": len(self.bad_records), "replacements": dict(self.replacements),
            "bad_records": [{"id": b.id, "reason": b.reason, "stage": b.stage, "fate": fate}
                            for b, fate in zip(self.bad_records, self.fates)],
            "withdrawn": dict(self.withdrawn),
        }


@dataclass
class LoaderStats:
    bytes_through_controller: int = 0
    """Serialized bytes the controller sent or received for data (refs counted as their ids)."""
    bad_record_counts: BadRecordCounts = field(default_factory=BadRecordCounts)
    """The bad-record policy's running totals (the policy's own object, read live; the `num_*`
    properties below are views of it)."""
    num_rerouted: int = 0
    """Prompts re-routed after their actor died."""
    loader_s: float = 0.0
    """Controller seconds the caller of next_step waited (probing, dispatch, decode checks, or
    decoding for the baseline): the controller's part of the exposed data time."""
    compose_s: float = 0.0
    """Seconds spent composing steps (probe + dispatch), in the background for ShadowLoader."""

    @property
    def num_bad(self) -> int:
        """Bad rows met so far."""
        return self.bad_record_counts.num_bad

    @property
    def num_replaced(self) -> int:
        """Bad rows replaced (policy replace)."""
        return self.bad_record_counts.num_replaced

    @property
    def num_skipped(self) -> int:
        """Slots dropped (policy skip, or replace with the epoch's rows used up: `num_unreplaced`)."""
        return self.bad_record_counts.num_skipped + self.bad_record_counts.num_unreplaced

    @property
    def num_unreplaced(self) -> int:
        """Slots policy replace had to drop: no unused row left in the epoch."""
        return self.bad_record_counts.num_unreplaced

    @property
    def num_withdrawn(self) -> int:
        """Prompts withdrawn from a handed-out step (decode failed after re-routing)."""
        return self.bad_record_counts.num_withdrawn

    def as_dict(self) -> dict[str, Any]:
        """Every counter and timing as plain values (the `num_*` views included)."""
        names = ("bytes_through_controller", "num_bad", "num_replaced", "num_skipped", "num_unreplaced",
                 "num_withdrawn", "num_rerouted", "loader_s", "compose_s")
        return {name: getattr(self, name) for name in names}


def payload_bytes(obj: Any) -> int:
    """Pickled size of `obj`, with each Ray ObjectRef counted as its id (what Ray ships for it)."""
    class _Pickler(pickle.Pickler):
        def persistent_id(self, value):
            return value.binary() if isinstance(value, ray.ObjectRef) else None

    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.tell()


def requests_for_samples(step: LoaderStep, samples: Sequence[SampleId]) -> list[SliceRequest]:
    """Whole-item requests for the prompts of `samples` (a prompt's items once per worker)."""
    metas = {p.key: p.meta for p in step.prompts}
    prompts = list(dict.fromkeys(sample.prompt for sample in samples))
    return [SliceRequest(key, index) for key in prompts for index in range(len(metas[key].items))]


def request_rows(layout: Any, request: SliceRequest) -> int:
    """Pixel rows (patches) `request` names in an item of `layout`."""
    stop = layout.grid_thw[0] if request.t_stop is None else request.t_stop
    return (stop - request.t_start) * layout.rows_per_group


class StepSource:
    """Step composition shared by ProxyLoader and the centralised baseline: the order and the
    bad-record policy (`bad_records.BadRecordPolicy`), with the probe injected."""

    def __init__(self, records: Sequence[Any], config: LoaderConfig, probe: Callable[[list], list],
                 bad_record_policy: str = "skip"):
        """`bad_record_policy`: the run's `flexrl.data.bad_record_policy` (skip | replace | error)."""
        self.records, self.config, self._probe = list(records), config, probe
        self.order = EpochOrder(len(self.records), config.seed, config.shuffle)
        self.policy = BadRecordPolicy(bad_record_policy, self.order, self._probe_rows)
        self.stats = LoaderStats(bad_record_counts=self.policy.counts)
        self._next_index = 0
        self.lock = threading.RLock()
        """Held while the order, the probe or the policy is used: compose and settle, and repairs
        from workers, may run on different threads."""

    def compose(self) -> LoaderStep:
        """Choose and probe the next step's prompts, applying the bad-record policy."""
        with self.lock:
            index, self._next_index = self._next_index, self._next_index + 1
            epoch, samples, report = self.policy.compose(index, self.config.global_batch)
        prompts = [StepPrompt(PromptKey(index, slot), sample) for slot, sample in enumerate(samples)]
        return LoaderStep(index, epoch, prompts, self.config.num_samples_per_prompt,
                          report.bad_records, report.replacements, rows=report.rows, fates=report.fates)

    def settle(self, step: LoaderStep, decode: Callable[[StepPrompt], Any]) -> LoaderStep:
        """Apply the bad-record policy to prompts that fail to decode. `decode(prompt)` returns
        None when the prompt's pixels are ready, else its `BadRecord`; a substitute (policy
        replace) takes the failed prompt's slot and is decoded the same way."""
        kept = []
        for prompt in step.prompts:
            while prompt is not None and (bad := decode(prompt)) is not None:
                prompt = self.after_decode_failure(step, prompt, bad)
            if prompt is not None:
                kept.append(prompt)
        step.prompts = kept
        return step

    def after_decode_failure(self, step: LoaderStep, prompt: StepPrompt, bad: Any) -> StepPrompt | None:
        """Policy for `prompt` of a step not yet handed out: its substitute in the same slot, or None."""
        with self.lock:
            substitute = self.policy.resolve(step.step, bad, step.bad_report, failed_id=prompt.meta.id)
        return None if substitute is None else StepPrompt(prompt.key, substitute)

    def withdraw(self, step: LoaderStep, prompt_id: str, bad: Any) -> None:
        """Policy for a prompt of a step already handed out whose decode failed (see bad_records)."""
        with self.lock:
            self.policy.withdraw(step.step, bad, step.bad_report, failed_id=prompt_id)

    def _probe_rows(self, rows: list[int]) -> list[Any]:
        entries = [self.records[row] for row in rows]
        good = [entry for entry in entries if not is_bad(entry)]
        probed = iter(self._probe(good) if good else [])
        return [entry if is_bad(entry) else next(probed) for entry in entries]


class ProxyLoader:
    """ShadowLoader's controller side: metadata, routing and references only."""

    def __init__(self, records: Sequence[Any], pool: Any, config: LoaderConfig, bad_record_policy: str = "skip",
                 destinations: Callable[[PromptKey], Mapping[str, float]] | None = None):
        """`pool`: a `PreprocessPool` (or a stand-in with its methods); `config`: the run's
        `flexrl.data.loader`; `bad_record_policy`: its `flexrl.data.bad_record_policy`;
        `destinations`: prompt -> {Ray node id: weight of its consumers there}, for a caller that
        knows at dispatch time where each prompt's pixels will be used (None: the nodes that asked
        for pixels so far, see the module docstring)."""
        self.pool, self.config, self.destinations = pool, config, destinations
        self.consumer_rows: dict[str, float] = {}
        """Ray node id -> pixel rows its consumers asked for so far (`assignment`'s `consumer_node`)."""
        self._actor_nodes: Mapping[str, str] = getattr(pool, "actor_nodes", {})
        self.source = StepSource(records, config, self._probe, bad_record_policy)
        self.store = MetaStore(config.num_samples_per_prompt)
        self._upcoming: deque[Future] = deque()  # composed (or composing) steps, in order
        self._composer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="proxy-compose")
        self._metas: dict[PromptKey, Any] = {}  # kept for re-routing
        self._handed_out: dict[int, LoaderStep] = {}  # steps returned by next_step, until released
        self._lock = threading.RLock()

    @property
    def stats(self) -> LoaderStats:
        return self.source.stats

    def _probe(self, records: list) -> list:
        metas = self.pool.probe(records)
        self.stats.bytes_through_controller += payload_bytes(records) + payload_bytes(metas)
        return metas

    def next_step(self) -> LoaderStep:
        """The next step, its decodes done and decode failures settled; the following
        `lookahead_steps` steps are being composed and decoded in the background."""
        started = time.perf_counter()
        timeout_s = self.pool.config.timeout_s
        if not self._upcoming:
            self._upcoming.append(self._composer.submit(self._compose_and_dispatch))
        step = self._upcoming.popleft().result(timeout=timeout_s)
        while len(self._upcoming) < self.config.lookahead_steps:
            self._upcoming.append(self._composer.submit(self._compose_and_dispatch))
        step = self.source.settle(step, self._decode_outcome)
        with self._lock:
            self._handed_out[step.step] = step
        self.stats.loader_s += time.perf_counter() - started
        return step

    def skip_steps(self, num_steps: int) -> None:
        """Replay the order and the bad-record policy over the next `num_steps` steps without
        decoding anything (a resumed run continues where the interrupted one stopped: the same
        records per step, the same substitutes). Only before the first `next_step`."""
        if self._upcoming or self._handed_out:
            raise RuntimeError("ProxyLoader.skip_steps: steps were already composed; skip before the first next_step")
        for _ in range(num_steps):
            self.source.compose()

    def wait_composed(self) -> None:
        """Block until every look-ahead step is probed and dispatched (tests, shutdown)."""
        for future in list(self._upcoming):
            future.result(timeout=self.pool.config.timeout_s)

    def close(self) -> None:
        """Stop composing look-ahead steps (call before shutting the pool down)."""
        for future in self._upcoming:
            future.cancel()
        self._composer.shutdown(wait=True)

    def _compose_and_dispatch(self) -> LoaderStep:
        started = time.perf_counter()
        step = self.source.compose()
        with self._lock:
            for prompt in step.prompts:
                self._dispatch(prompt)
        self.stats.compose_s += time.perf_counter() - started
        return step

    def _decode_outcome(self, prompt: StepPrompt) -> Any:
        """None once `prompt`'s preprocess task has produced its slices, else its `BadRecord`
        (the failed prompt is forgotten). A task lost with its actor is re-routed and waited for,
        until a live actor answers: a step is never handed out with an unknown outcome."""
        with self._lock:
            if prompt.key not in self.store.keys(prompt.key.step):
                self._dispatch(prompt)  # a substitute (policy replace) taking a failed slot
        return self._task_outcome(prompt.key, forget_failed=True)

    def _task_outcome(self, key: PromptKey, forget_failed: bool) -> Any:
        """Wait for `key`'s current task, re-routing it while its actor is lost: None (slices
        ready) or the `BadRecord` of a `DecodeFailure`. Each loss marks one actor dead, so this
        ends; with no live actor left the pool raises."""
        while True:
            entry = self.store.entry(key)
            try:
                result = self.pool.task_result(entry.task_ref)
            except self.pool.lost_errors:
                self._reroute(key, entry.generation)
                continue
            self.stats.bytes_through_controller += payload_bytes(result)
            if not isinstance(result, DecodeFailure):
                return None
            if forget_failed:
                with self._lock:
                    self.store.remove(key)
                    self._metas.pop(key, None)
            return result.bad

    def _dispatch(self, prompt: StepPrompt) -> None:
        layouts = item_layouts(prompt.meta, self.config.groups_per_chunk)
        cost = max(1.0, float(sum(layout.num_patches for layout in layouts)))
        self.store.add(PromptEntry(prompt.key, prompt.meta.id, layouts, cost))
        self._route(prompt.key, prompt.meta)

    def _route(self, key: PromptKey, meta: Any) -> None:
        entry = self.store.entry(key)
        where = dict(self.destinations(key)) if self.destinations is not None else dict(self.consumer_rows)
        if where:
            owner, ref = self.pool.submit(key, meta, entry.layouts, entry.cost, destinations=where)
        else:
            owner, ref = self.pool.submit(key, meta, entry.layouts, entry.cost)
        self.stats.bytes_through_controller += payload_bytes((key, meta, entry.layouts, ref))
        self.store.route(key, owner, ref)
        self._metas[key] = meta

    def _source(self, key: PromptKey) -> PromptSource:
        entry = self.store.entry(key)
        return PromptSource(key, entry.layouts, entry.generation, task_ref=entry.task_ref,
                            owner_node=self._actor_nodes.get(entry.owner, ""))

    def assignment(self, step: LoaderStep, requests: Sequence[SliceRequest],
                   consumer_node: str = "") -> WorkerAssignment:
        """A worker's share of `step`: its requests plus a reference per prompt (no pixels).
        `consumer_node`: the worker's Ray node id (learned as a destination of later decodes)."""
        with self._lock:
            sources = {request.prompt: self._source(request.prompt) for request in requests}
            if consumer_node:
                rows = sum(request_rows(sources[request.prompt].layouts[request.item_index], request)
                           for request in requests)
                self.consumer_rows[consumer_node] = self.consumer_rows.get(consumer_node, 0.0) + rows
        assignment = WorkerAssignment(step.step, tuple(requests), sources)
        self.stats.bytes_through_controller += payload_bytes(assignment)
        return assignment

    def repair(self, key: PromptKey, failed_generation: int) -> PromptSource:
        """A fresh source for `key`, whose fetch failed because its actor is gone: re-routes every
        prompt of that actor (once per failure; concurrent repairs just get the new reference).
        For a step already handed out, waits for the re-decode: if it fails, the prompt is
        withdrawn by the policy (reported in the step, counted; ValueError under `error`) before
        the caller sees the failure, so whichever process asks, the decision is the loader's and
        is taken once."""
        self._reroute(key, failed_generation)
        with self._lock:
            step = self._handed_out.get(key.step)
            prompt_id = self._metas[key].id if key in self._metas else None
        if step is not None and prompt_id is not None and prompt_id not in step.withdrawn:
            bad = self._task_outcome(key, forget_failed=False)
            if bad is not None:
                with self._lock:
                    if prompt_id not in step.withdrawn and bad not in step.bad_records:
                        self.source.withdraw(step, prompt_id, bad)
        with self._lock:
            return self._source(key)

    def _reroute(self, key: PromptKey, failed_generation: int) -> None:
        """Mark the owner of `key`'s failed generation dead and re-route all its prompts (once)."""
        with self._lock:
            entry = self.store.entry(key)
            if entry.generation == failed_generation:
                dead = entry.owner
                if dead in self.pool.alive:
                    self.pool.mark_dead(dead)
                for lost in self.store.owned_by(dead):
                    self._route(lost, self._metas[lost])
                    self.stats.num_rerouted += 1

    def release(self, step: LoaderStep) -> None:
        """Forget `step`: actors drop its cached slices."""
        with self._lock:
            self._handed_out.pop(step.step, None)
            released = self.store.release_step(step.step)
            for keys in released.values():
                for key in keys:
                    self._metas.pop(key, None)
        self.pool.release(released)
