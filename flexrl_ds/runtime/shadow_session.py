"""`flexrl logprobs --loader shadow`, controller side: metadata and references only, never pixels.

1. `connect_ray` joins the cluster named by RAY_ADDRESS, an already initialised session (tests), or
   starts a local one (stopped again at the end).
2. The records (paths and text) go to a `ProxyLoader` over a `PreprocessPool`: the actors probe the
   media headers (exact grids, vision tokens) and decode every prompt once into per-slice objects in
   their own object stores; the controller receives `SampleMeta`s and object references.
3. The text is tokenized here with the model's tokenizer (metadata-sized): `EncodedSample`s whose
   vision items hold shape-only `TensorPlaceholder`s where the local path holds pixel rows. The
   planner, and every rank's layout and vision route, need nothing more.
4. The step's `PromptSource`s (references only) are posted on a small named Ray actor
   (`SourceBoard`). The spawned ranks — Ray drivers of the same cluster — take them from it, so the
   references travel in-band and Ray's reference counting covers every borrower (an ObjectRef
   pickled through multiprocessing would be pinned for the controller's lifetime). Each rank then
   fetches exactly the slices of its vision units (flexrl_ds/runtime/rank_pixels.py).

Settings: `flexrl.data` of the run config (`--config`; `loader.config.DataConfig`), adapted to a
scoring tool (`tool_loader_configs`). `ShadowSession` owns all of it (context manager: actors, board and a cluster started here are
torn down on exit). Bytes the controller handled are counted as `payload_bytes` counts them
(pickled size, object references as their ids).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray

from flexrl_ds.loader.config import DataConfig, LoaderConfig, PoolConfig


@dataclass
class ShadowSettings:
    """Overrides of `flexrl.data.pool` / `flexrl.data.loader` for `flexrl logprobs --loader shadow`."""

    num_actors_per_node: int | None = None
    """Preprocessing actors per Ray node (`--actors`); None: `flexrl.data.pool.num_actors_per_node`."""
    num_cpus_per_actor: float | None = None
    """Ray CPUs reserved per actor (`--cpus-per-actor`); None: `flexrl.data.pool.num_cpus_per_actor`."""
    groups_per_chunk: int = 1
    """Temporal patch groups per cached video slice. A rank pulls whole slices; vision balancing
    deals a video's groups out over the ranks one by one, so 1 (a slice per group) lets every rank
    pull exactly its groups, where larger chunks make ranks pull their neighbours' groups too."""
    timeout_s: float = 600.0
    """Longest wait for one probe, decode or fetch."""

    def __post_init__(self) -> None:
        if self.num_actors_per_node is not None and self.num_actors_per_node < 1:
            raise ValueError(f"--actors must be at least 1, got {self.num_actors_per_node}")
        if self.num_cpus_per_actor is not None and self.num_cpus_per_actor <= 0:
            raise ValueError(f"--cpus-per-actor must be positive, got {self.num_cpus_per_actor}")
        if self.groups_per_chunk < 1:
            raise ValueError(f"groups_per_chunk must be at least 1, got {self.groups_per_chunk}")


def tool_loader_configs(data_config: DataConfig, settings: ShadowSettings,
                        num_records: int) -> tuple[LoaderConfig, PoolConfig, str]:
    """(loader config, pool config, bad-record policy) from the run config's `flexrl.data`, adapted
    to a scoring tool: the whole file is one step in file order, without look-ahead; bad records are
    skipped (as by `--loader local`) unless the policy is `error`; `settings` override the pool."""
    policy = "error" if data_config.bad_record_policy == "error" else "skip"
    loader = dataclasses.replace(data_config.loader, global_batch=max(1, num_records), num_samples_per_prompt=1,
                                 shuffle=False, lookahead_steps=0, groups_per_chunk=settings.groups_per_chunk)
    pool = data_config.pool
    pool = dataclasses.replace(
        pool, timeout_s=settings.timeout_s,
        num_actors_per_node=settings.num_actors_per_node or pool.num_actors_per_node,
        num_cpus_per_actor=settings.num_cpus_per_actor or pool.num_cpus_per_actor)
    return loader, pool, policy


@dataclass(frozen=True)
class ShadowHandle:
    """What a rank needs to pull its pixels; the same on every rank, no object references inside."""

    ray_address: str
    """GCS address of the cluster (ranks join it with `ray.init(address=...)`)."""
    namespace: str
    """Ray namespace of the board actor."""
    board_name: str
    """Name of the `SourceBoard` actor holding the step's `PromptSource`s."""
    step: int
    """Loader step the sources belong to."""
    prompt_keys: dict[str, Any]
    """Sequence id -> its `PromptKey` (step, slot)."""
    timeout_s: float = 600.0
    """Longest wait for one fetch."""


@ray.remote(num_cpus=0)
class SourceBoard:
    """Holds one step's `PromptSource`s (references only) for the ranks to take in-band."""

    def __init__(self):
        self.sources: dict[Any, Any] = {}

    def post(self, sources: dict[Any, Any]) -> int:
        self.sources = dict(sources)
        return len(self.sources)

    def take(self) -> dict[Any, Any]:
        return self.sources


@dataclass
class ShadowStep:
    """The step as the controller holds it: metadata samples and the ranks' handle."""

    samples: dict[str, Any]
    """EncodedSample per sequence id, in file order; vision items hold `TensorPlaceholder`s."""
    handle: ShadowHandle
    """Where ranks find the step's sources."""
    bad_records: list[Any] = field(default_factory=list)
    """Records skipped (read, probe, decode or missing response), with reasons."""


def connect_ray(num_cpus: int) -> bool:
    """Join RAY_ADDRESS, reuse an initialised session, or start a local cluster; True if started here."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, configure_logging=False)
        return False
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    return True


def _scorable(records: list[Any], response_key: str, has_vision: bool) -> list[Any]:
    """Records with something to score (others become `BadRecord`s at stage read, as in the local path)."""
    from flexrl_ds.media.types import BadRecord
    from flexrl_ds.models.processing import _field

    out = []
    for record in records:
        if not isinstance(record, BadRecord):
            if not isinstance(_field(record, response_key), str):
                record = BadRecord(record.id, f"no {response_key!r} text to score", record.index, "read")
            elif record.items and not has_vision:
                record = BadRecord(record.id, "has media but the model has no vision tower", record.index, "read")
        out.append(record)
    return out


def placeholder_items(meta: Any) -> list[Any]:
    """VisionItems of a probed sample with shape-only placeholders instead of pixel rows."""
    from flexrl_ds.models.processing import VisionItem

    return [VisionItem(item.kind, meta.item_placeholder(index), tuple(item.grid_thw), item.second_per_grid_t or 1.0)
            for index, item in enumerate(meta.items)]


class ShadowSession:
    """Ray cluster, preprocessing actors, ProxyLoader and source board for one `flexrl logprobs` run."""

    def __init__(self, model_dir: str, data_path: str, response_key: str, settings: ShadowSettings,
                 data_config: Any = None):
        """data_config: the run config's `flexrl.data` (`DataConfig`; None: defaults); the vision
        geometry always comes from the model's saved processor, as in `--loader local`."""
        from flexrl_ds.media.processor_files import has_processor_files

        self.model_dir, self.data_path, self.response_key, self.settings = model_dir, data_path, response_key, settings
        self.data_config = data_config if data_config is not None else DataConfig()
        if has_processor_files(model_dir):
            self.data_config = self.data_config.with_processor_dir(model_dir)
        self.pool = self.loader = self.board = self.step = None
        self.started_ray = False

    def __enter__(self) -> ShadowSession:
        from flexrl_ds.loader.actors import PreprocessPool
        from flexrl_ds.media.preprocess import SamplePreprocessor
        from flexrl_ds.media.records import read_dataset
        from flexrl_ds.models.processing import SampleEncoder

        self.encoder = SampleEncoder(self.model_dir)
        self.records = _scorable(read_dataset(self.data_path, self.data_config.media_root), self.response_key, self.encoder.has_vision)
        self.loader_config, pool_config, self.bad_record_policy = tool_loader_configs(
            self.data_config, self.settings, len(self.records))
        cpus = int(pool_config.num_actors_per_node * pool_config.num_cpus_per_actor) + 2
        started = time.perf_counter()
        self.started_ray = connect_ray(max(4, cpus))
        joined = time.perf_counter()
        self.pool = PreprocessPool(functools.partial(SamplePreprocessor, self.data_config), pool_config)
        self.pool.wait_ready()
        print(f"Ray {'started' if self.started_ray else 'joined'} in {joined - started:.1f} s; "
              f"{len(self.pool.alive)} preprocessing actors ready in {time.perf_counter() - joined:.1f} s", flush=True)
        return self

    def load_step(self) -> ShadowStep:
        """Probe, decode (on the actors) and tokenize every record as one step; post its sources."""
        from flexrl_ds.loader.proxy_loader import ProxyLoader, requests_for_samples
        from flexrl_ds.models.processing import _field

        encoder = self.encoder
        self.loader = ProxyLoader(self.records, self.pool, self.loader_config, self.bad_record_policy)
        self.step = self.loader.next_step()  # probed, decoded on the actors, decode failures settled
        for bad in self.step.bad_records:
            print(f"skipped record {bad.id!r}: {bad.reason}", file=sys.stderr)
        if not self.step.prompts:
            raise ValueError(f"{self.data_path}: no usable records")
        samples, keys = {}, {}
        for prompt in self.step.prompts:
            record = prompt.meta.record
            samples[prompt.meta.id] = encoder.encode_items(prompt.meta.id, record.prompt,
                                                           _field(record, self.response_key),
                                                           placeholder_items(prompt.meta))
            keys[prompt.meta.id] = prompt.key
        assignment = self.loader.assignment(self.step, requests_for_samples(self.step, self.step.sample_ids()))
        name = f"flexrl-logprobs-sources-{uuid.uuid4().hex[:12]}"
        self.board = SourceBoard.options(name=name).remote()
        ray.get(self.board.post.remote(assignment.sources), timeout=self.settings.timeout_s)
        handle = ShadowHandle(*self.ray_address(), name, self.step.step, keys, self.settings.timeout_s)
        return ShadowStep(samples, handle, list(self.step.bad_records))

    def ray_address(self) -> tuple[str, str]:
        """(GCS address, namespace) of the cluster, for ranks joining it as drivers."""
        context = ray.get_runtime_context()
        return context.gcs_address, context.namespace

    def reroute_lost(self) -> int:
        """After a failed rank run: re-route the prompts of preprocessing actors that died since the
        step was loaded (`ProxyLoader.repair`: decoded again on live actors) and post the new sources
        on the board. Returns the prompts re-routed (0: no actor died, the failure is something else)."""
        from flexrl_ds.loader.proxy_loader import requests_for_samples

        dead = []
        for name in self.pool.alive:
            try:
                ray.get(self.pool.actors[name].stats.remote(), timeout=self.settings.timeout_s)
            except self.pool.lost_errors:
                dead.append(name)
        before = self.loader.stats.num_rerouted
        for name in dead:
            owned = self.loader.store.owned_by(name)
            if owned:
                self.loader.repair(owned[0], self.loader.store.entry(owned[0]).generation)
            else:
                self.pool.mark_dead(name)
        rerouted = self.loader.stats.num_rerouted - before
        if rerouted:
            assignment = self.loader.assignment(self.step, requests_for_samples(self.step, self.step.sample_ids()))
            ray.get(self.board.post.remote(assignment.sources), timeout=self.settings.timeout_s)
        return rerouted

    @property
    def controller_bytes(self) -> int:
        """Data bytes through the controller so far: records, metadata, references (no pixels)."""
        return self.loader.stats.bytes_through_controller if self.loader is not None else 0

    def __exit__(self, *exc) -> None:
        if self.board is not None:
            ray.kill(self.board, no_restart=True)
        if self.loader is not None:
            if self.step is not None:
                self.loader.release(self.step)
            self.loader.close()
        if self.pool is not None:
            self.pool.shutdown()
        if self.started_ray:
            ray.shutdown()
