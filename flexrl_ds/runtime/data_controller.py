"""The data controller of a training run: the ShadowLoader over many steps, metadata only.

The driver never holds pixels. `DataController` runs the `ProxyLoader` and its preprocessing
actors inside one `LoaderService` Ray actor (loader/loader_service.py), so that

- the driver asks for steps (`next_step`: probed metadata, shape-only placeholders, the step's
  bad-record report; the look-ahead steps decode meanwhile on the actors);
- every consumer of pixels (a rollout engine, a policy rank) gets a `PixelSource`, a small
  picklable handle: `fetch(step, requests)` asks the service for references to exactly the slices
  it names (giving its node, so that later decodes are routed to nodes where pixels are used:
  loader/routing.py `route_near`) and pulls them from the owning actors' object stores, counting
  the bytes that crossed nodes (`MaterializedStep.bytes_cross_node`); a slice whose actor died is
  repaired through the same service (`RemoteRepair`: re-routed once, or withdrawn by the
  bad-record policy), whichever process finds the failure;
- a resumed run replays the loader's order up to its position (`skip_steps`: probes only, no
  decode), so step N+1 draws the same records as in an uninterrupted run.

Sample identity, end to end: a prompt is `PromptKey(step, slot)` (str "s3p1"), one of its n GRPO
samples is `SampleId(step, slot, k)` (str "s3p1k0": the sequence id in plans and outputs); the
dataset record behind a prompt keeps its own `Record.id`.
"""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import ray

from flexrl_ds.loader.loader_service import LoaderService, RemoteRepair
from flexrl_ds.loader.materializer import Materializer, MaterializedStep, RayFetcher, SliceRequest
from flexrl_ds.loader.metastore import PromptKey, SampleId
from flexrl_ds.media.preprocess import SamplePreprocessor
from flexrl_ds.media.types import BadRecord, Record


def sample_name(sample: SampleId) -> str:
    """The sequence id of a GRPO sample: "s<step>p<slot>k<sample index>"."""
    return f"s{sample.step}p{sample.slot}k{sample.sample_index}"


def prompt_name(key: PromptKey) -> str:
    """The id of a prompt within its step: "s<step>p<slot>"."""
    return f"s{key.step}p{key.slot}"


def record_fields(record: Record) -> dict[str, Any]:
    """A record as its dataset JSON fields (what custom rewards receive)."""
    fields = {"id": record.id, "prompt": record.prompt, "answer": record.answer,
              "data_source": record.data_source, **record.extra}
    images = [str(item.path) for item in record.items if item.kind == "image"]
    videos = [str(item.path) for item in record.items if item.kind == "video"]
    if images:
        fields["images"] = images
    if videos:
        fields["videos"] = videos
    return fields


@dataclass
class ControllerPrompt:
    """One prompt of a step as the driver holds it: metadata, no pixels."""

    key: PromptKey
    """(step, slot) of the prompt."""
    meta: Any
    """Its `SampleMeta`: the record, probed media, exact grids and vision-token counts."""

    @property
    def record(self) -> Record:
        return self.meta.record


@dataclass
class ControllerStep:
    """One step's prompts and its bad-record report."""

    step: int
    """Loader step (0-based; equals the GRPO step)."""
    prompts: list[ControllerPrompt]
    """The prompts trained on, in slot order (bad records skipped or replaced by the policy)."""
    num_samples_per_prompt: int
    """GRPO group size n."""
    report: dict[str, Any] = field(default_factory=dict)
    """`LoaderStep.report()`: ids, bad records with reasons, replacements, withdrawals."""

    def sample_ids(self, prompt: ControllerPrompt) -> list[SampleId]:
        return [SampleId(prompt.key.step, prompt.key.slot, k) for k in range(self.num_samples_per_prompt)]


@dataclass(frozen=True)
class PixelSource:
    """What a pixel consumer (engine host, policy rank) needs to pull slices; picklable, no refs."""

    service_name: str
    """Name of the `LoaderService` actor (looked up in `namespace`: works from any driver or
    actor of the cluster, including ranks started by another launcher)."""
    namespace: str
    """Ray namespace of the service."""
    bad_record_policy: str = "skip"
    """`flexrl.data.bad_record_policy` (what `Materializer.get` does with a withdrawn prompt)."""
    timeout_s: float = 600.0
    """Longest wait for one service call or fetch."""

    @property
    def service(self) -> Any:
        return ray.get_actor(self.service_name, namespace=self.namespace)

    def start(self, step: int, requests: Sequence[SliceRequest]) -> Materializer:
        """Begin pulling `requests` of `step` in the background; `.get(step)` on the result waits."""
        service, fetcher = self.service, RayFetcher(timeout_s=self.timeout_s)
        assignment = ray.get(service.assignment.remote(step, list(requests), fetcher.node_id), timeout=self.timeout_s)
        materializer = Materializer(fetcher,
                                    repair=RemoteRepair(service, self.timeout_s),
                                    bad_record_policy=self.bad_record_policy)
        materializer.prefetch(assignment)
        return materializer

    def fetch(self, step: int, requests: Sequence[SliceRequest]) -> MaterializedStep:
        """Pull `requests` of `step` and wait for them."""
        materializer = self.start(step, requests)
        try:
            return materializer.get(step)
        finally:
            materializer.close()


def usable_records(entries: Sequence[Any], source: str) -> list[Any]:
    """The dataset's rows (bad ones stay in, the loader's policy handles them); ValueError when
    no row is usable at all."""
    if not any(not isinstance(entry, BadRecord) for entry in entries):
        reasons = "; ".join(f"{bad.id!r}: {bad.reason}" for bad in entries[:5] if isinstance(bad, BadRecord))
        raise ValueError(f"{source}: the dataset has no usable records" + (f" ({reasons})" if reasons else ""))
    return list(entries)


class DataController:
    """The run's ShadowLoader (a `LoaderService` actor) seen from the driver."""

    def __init__(self, records: Sequence[Any], data_config: Any, timeout_s: float = 600.0):
        """`data_config`: the run's `flexrl.data` (with the model's processor settings applied)."""
        self.data_config, self.timeout_s = data_config, timeout_s
        self.num_samples_per_prompt = data_config.loader.num_samples_per_prompt
        name = f"flexrl-loader-{uuid.uuid4().hex[:12]}"
        namespace = ray.get_runtime_context().namespace
        self.service = LoaderService.options(  # type: ignore[attr-defined]  # a Ray actor class
            name=name, namespace=namespace, max_concurrency=8).remote(
            list(records), functools.partial(SamplePreprocessor, data_config), data_config)
        ray.get(self.service.wait_ready.remote(), timeout=timeout_s)
        self.pixels = PixelSource(name, namespace, data_config.bad_record_policy, timeout_s)

    def skip_steps(self, num_steps: int) -> None:
        """Replay the loader's order over `num_steps` steps without decoding (resume)."""
        if num_steps:
            ray.get(self.service.skip_steps.remote(num_steps), timeout=self.timeout_s)

    def next_step(self) -> ControllerStep:
        """The next step: decoded on the actors, decode failures settled by the policy."""
        step = ray.get(self.service.next_step.remote(), timeout=self.timeout_s)
        prompts = [ControllerPrompt(prompt.key, prompt.meta) for prompt in step.prompts]
        return ControllerStep(step.step, prompts, step.num_samples_per_prompt, step.report())

    def report(self, step: int) -> dict[str, Any]:
        """The step's current report (withdrawals found after hand-out included)."""
        return ray.get(self.service.report.remote(step), timeout=self.timeout_s)

    def stats(self) -> dict[str, Any]:
        return ray.get(self.service.stats.remote(), timeout=self.timeout_s)

    def peak_rss_bytes(self) -> int:
        """The loader service process's peak resident memory (where `flexrl.data.loading` "central"
        decodes and holds each step's pixels)."""
        return ray.get(self.service.peak_rss_bytes.remote(), timeout=self.timeout_s)

    def release(self, step: int) -> None:
        """Forget `step`: the actors drop its cached slices."""
        ray.get(self.service.release.remote(step), timeout=self.timeout_s)

    def close(self) -> None:
        try:
            ray.get(self.service.shutdown.remote(), timeout=self.timeout_s)
        finally:
            ray.kill(self.service, no_restart=True)
