"""Typed settings of the ShadowLoader (sections `flexrl.data.loader`, `flexrl.data.pool` and the
whole `flexrl.data`).

One dataclass per section, taken as it is by the code that owns it:

- `LoaderConfig` (`flexrl.data.loader`) by `ProxyLoader` and `CentralLoader`;
- `PoolConfig` (`flexrl.data.pool`) by `PreprocessPool`;
- `DataConfig` (`flexrl.data`) = the media settings (`media.config.MediaConfig`: pixel geometry,
  decoding, bad-record policy) plus those two sections. The media layer never sees the loader's
  sections; a `DataConfig` is a `MediaConfig`, so `SamplePreprocessor(run.flexrl.data)` works.

The one setting both sides read, `flexrl.data.bad_record_policy`, stays in `MediaConfig` (the
offline tools apply it too) and is passed to the loader as an argument::

    data = load_run_config("ds_configs/zero3_flexrl.json").flexrl.data
    pool = PreprocessPool(functools.partial(SamplePreprocessor, data), data.pool)
    loader = ProxyLoader(records, pool, data.loader, bad_record_policy=data.bad_record_policy)

Torch-free and Ray-free, so that loading a run config imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flexrl_ds.media.config import MediaConfig


@dataclass
class LoaderConfig:
    """Step composition and look-ahead of the training loader (section `flexrl.data.loader`)."""

    global_batch: int = 8
    """Prompts per step (B)."""
    num_samples_per_prompt: int = 1
    """GRPO group size n: samples per prompt, all sharing the prompt's one decode."""
    seed: int = 0
    """Seed of the per-epoch permutation of dataset rows."""
    shuffle: bool = True
    """Visit rows in a seeded permutation (False: file order)."""
    lookahead_steps: int = 1
    """Steps whose probing and decoding are dispatched ahead of the step being trained on."""
    groups_per_chunk: int = 4
    """Temporal patch groups (2 frames each for Qwen2.5-VL) per cached video slice."""

    def __post_init__(self) -> None:
        for name in ("global_batch", "num_samples_per_prompt", "groups_per_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"flexrl.data.loader.{name}: must be at least 1, got {getattr(self, name)}")
        if self.lookahead_steps < 0:
            raise ValueError(f"flexrl.data.loader.lookahead_steps: must be >= 0, got {self.lookahead_steps}")


@dataclass
class PoolConfig:
    """ShadowLoader preprocessing actors (section `flexrl.data.pool`)."""

    num_actors_per_node: int = 1
    """Preprocessing actors started on every alive Ray node."""
    num_cpus_per_actor: float = 1.0
    """CPUs Ray reserves per actor; fractions allowed (e.g. 0.5 packs two actors per core)."""
    probe_chunk_size: int = 8
    """Records per metadata-probe task."""
    timeout_s: float = 600.0
    """Longest wait for one probe or decode task before the step fails with a TimeoutError."""
    locality_slack: float = 1.0
    """Node-aware routing (`routing.route_near`): a prompt goes to an actor on a node that will
    consume its pixels unless that actor's outstanding load exceeds the least-loaded actor's by
    more than this many times the prompt's own predicted cost; then to the least-loaded actor.
    0: locality only breaks ties; a large value: always decode where the pixels are used."""

    @property
    def cpus_per_node(self) -> float:
        """Ray CPUs the pool's actors reserve on every node."""
        return self.num_actors_per_node * self.num_cpus_per_actor

    def __post_init__(self) -> None:
        for name in ("num_actors_per_node", "probe_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"flexrl.data.pool.{name}: must be at least 1, got {getattr(self, name)}")
        if not self.locality_slack >= 0:
            raise ValueError(f"flexrl.data.pool.locality_slack: must be >= 0, got {self.locality_slack}")
        for name in ("num_cpus_per_actor", "timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"flexrl.data.pool.{name}: must be positive, got {getattr(self, name)}")


@dataclass
class DataConfig(MediaConfig):
    """ShadowLoader data settings (section `flexrl.data`): the media settings of `MediaConfig`
    (flexrl_ds/media/config.py) plus the training loader and its preprocessing actors."""

    loader: LoaderConfig = field(default_factory=LoaderConfig)
    """Training loader: batch, GRPO group size, order, look-ahead, slice size."""
    pool: PoolConfig = field(default_factory=PoolConfig)
    """Preprocessing actors: count per node, CPUs, probe chunking, timeout, locality slack."""
    loading: str = "shadow"
    """"shadow": the ShadowLoader (preprocessing actors decode a step ahead, consumers pull the
    slices they need from the actors' object stores); "central": the veRL-style baseline
    (loader/central_loader.py: one controller process probes and decodes each step when it is
    asked for, on the training loop's critical path, and every pixel consumers get passes through
    it). For measuring what ShadowLoader saves (metrics.jsonl `loader`); `flexrl.data.pool` is
    then unused."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.loading not in LOADINGS:
            raise ValueError(f"flexrl.data.loading: {self.loading!r} is not one of {', '.join(LOADINGS)}")


LOADINGS = ("shadow", "central")
"""Values of `flexrl.data.loading`."""
