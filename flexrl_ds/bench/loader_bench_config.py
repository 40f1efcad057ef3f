"""What `flexrl bench loader` runs and what one run measured: options, their resolution into the
run's `flexrl.data` settings, and `RunResult`. Imports neither Ray nor torch: `flexrl --help`
registers the command from these (the runs themselves are in bench/loader_bench.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

from flexrl_ds.config.flexrl_config import load_run_config
from flexrl_ds.loader.config import DataConfig, LoaderConfig, PoolConfig

MODES = ("none", "central", "shadow")
"""none: the same loop with no data at all: the loop's own cost (Ray calls, sleep granularity)."""
DEFAULT_CPUS_PER_ACTOR = 0.5
"""Ray CPUs per preprocessing actor when neither --cpus-per-actor nor --config sets them (two actors
per core: the setting of every run recorded in docs/BENCHMARKS.md that does not name one)."""


@dataclass
class LoaderBenchConfig:
    """What `flexrl bench loader` runs."""

    data: str
    """Dataset file (JSONL/Parquet with media), e.g. from `flexrl make-dataset --mix video-heavy`."""
    global_batches: list[int]
    """Global batch sizes B (prompts per step) to measure."""
    steps: int
    """Measured steps per run."""
    actors: list[int]
    """Preprocessing actor counts K for the shadow runs."""
    compute_ms: float = 0.0
    """Simulated compute per step (ms): the time decoding can hide behind."""
    num_workers: int = 2
    """Worker actors standing in for training ranks."""
    num_samples_per_prompt: int | None = None
    """GRPO group size n (samples share their prompt's decode); None: the config's
    `flexrl.data.loader.num_samples_per_prompt`."""
    warmup_steps: int = 1
    """Steps run before measuring (actor start, first decode)."""
    num_cpus_per_actor: float | None = None
    """Ray CPUs reserved per preprocessing actor; None: the config's `flexrl.data.pool.num_cpus_per_actor`
    with --config, else `DEFAULT_CPUS_PER_ACTOR`."""
    seed: int | None = None
    """Sample order seed; None: the config's `flexrl.data.loader.seed`."""
    model_dir: str | None = None
    """Saved HF processor to take vision geometry from; None: the config's pixel settings."""
    modes: list[str] = field(default_factory=lambda: list(MODES))
    """Which of none / central / shadow to run (the ratios need central and shadow)."""
    run_config: str | None = None
    """DeepSpeed JSON whose `flexrl.data` section sets the loader, the pool, the bad-record policy
    and the pixel settings; None: `DataConfig()` defaults. The bench's
    options override it: B and K per run, n / seed / CPUs per actor / processor when given."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.warmup_steps < 0:
            raise ValueError("--steps must be at least 1 and warm-up steps non-negative")
        if min(self.global_batches) < 1 or min(self.actors) < 1 or self.num_workers < 1:
            raise ValueError("--global-batch, --actors and --workers must be at least 1")
        if self.compute_ms < 0:
            raise ValueError(f"--compute-ms must be non-negative, got {self.compute_ms}")
        if not self.modes or any(mode not in MODES for mode in self.modes):
            raise ValueError(f"--modes {self.modes}: choose from {', '.join(MODES)}")
        if not os.path.isfile(self.data):
            raise ValueError(f"--data {self.data}: file not found")
        if self.run_config is not None and not os.path.isfile(self.run_config):
            raise ValueError(f"--config {self.run_config}: file not found")
        self.data_config()  # a bad config, processor or override fails here, before Ray starts

    def data_config(self) -> DataConfig:
        """The run's `flexrl.data` (`DataConfig`): --config's (or the defaults), the processor of
        --model, and the bench's n, seed and CPUs per actor. B and K are set per run (`run_settings`)."""
        data = DataConfig()
        if self.run_config is not None:
            data = load_run_config(self.run_config).flexrl.data
        if self.model_dir:
            data = data.with_processor_dir(self.model_dir)
        cpus = self.num_cpus_per_actor
        if cpus is None and self.run_config is None:
            cpus = DEFAULT_CPUS_PER_ACTOR
        loader = _override(data.loader, num_samples_per_prompt=self.num_samples_per_prompt, seed=self.seed)
        return replace(data, loader=loader, pool=_override(data.pool, num_cpus_per_actor=cpus))


def _override(section: Any, **values: Any) -> Any:
    """`section` with the values that are not None (the options given on the command line)."""
    return replace(section, **{name: value for name, value in values.items() if value is not None})


def run_settings(data_config: DataConfig, batch: int, num_actors: int) -> tuple[LoaderConfig, PoolConfig]:
    """(LoaderConfig, PoolConfig) of one run: `data_config`'s loader and pool sections with global
    batch `batch` and `num_actors` preprocessing actors per node (0: no pool, the config's count kept)."""
    return (replace(data_config.loader, global_batch=batch),
            _override(data_config.pool, num_actors_per_node=num_actors or None))


@dataclass
class RunResult:
    mode: str
    global_batch: int
    actors: int
    steps: int
    compute_ms: float
    exposed_ms: float
    """Mean exposed data time per step."""
    exposed_ms_max: float
    worker_wait_ms: float
    """Mean over steps of the slowest worker's wait in Materializer.get."""
    controller_loader_ms: float
    """Mean controller time per step the loop waited inside next_step (probe/dispatch/decode checks,
    or decode for central)."""
    controller_bytes_per_step: float
    pixel_bytes_per_step: float
    """Pixel bytes the workers received per step."""
    controller_rss_start_mb: float
    controller_rss_peak_mb: float
    total_rss_peak_mb: float
    samples_per_s: float
    num_bad: int = 0
    cross_node_bytes_per_step: float = 0.0
    """Of `pixel_bytes_per_step`, bytes pulled from an actor on another node than the worker's."""
    num_withdrawn: int = 0
    """Prompts the workers got back withdrawn (decode failed after hand-out), summed over steps."""
    compose_ms: float = 0.0
    """Mean time per step spent composing steps (probe + dispatch; in the background for shadow)."""
    step_ms: list[float] = field(default_factory=list)
    phases_ms: dict[str, float] = field(default_factory=dict)
    """Mean over steps of `step_phases` (where the exposed time went, and the Materializer's
    background work)."""
    step_phases_ms: list[dict[str, float]] = field(default_factory=list)
    """`step_phases` of every measured step."""
