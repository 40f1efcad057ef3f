"""`flexrl bench zero3-host`: the host work of ZeRO-3's hooks on one rank, per setting, against the bare module.

On one GPU the ZeRO-3 engine ran the update at half the bare FlexUlysses module's speed (issue 40,
item 2). Each ZeRO-3 hook is Python on the host; the device waits for it when it falls behind. That
host work is measured here on the CPU: a model with a real shape's module tree (`shape`: the 3B's
36 decoder layers and 32 vision blocks, the released tower's geometry, the same 839 modules and
825 parameter tensors) at tiny widths, so that its compute is small and the engine's time over the
bare module's is the hooks' (on one rank a "gathered" parameter is a view of its partition: no copy,
no collective). One rank, gloo.

The samples are `flexrl bench update`'s (each of `prompts` records of a generated scoring set
`samples_per_prompt` times, `response_length` random response tokens), cut into micro-batches as the
trainer cuts them under the run config's `flexrl.sp` (one rank). Then:
- `bare`: `FlexUlyssesLM` forward and backward per micro-batch (no DeepSpeed);
- per setting of `SETTINGS` asked: a fresh copy of the model in a ZeRO-3 engine whose
  `zero_optimization` is the run config's with the setting's keys over it (written for the real
  shape, translated to the tiny one by bench/zero3_settings.py: the same parameters persistent, the
  same leaf modules, volumes as many decoder layers' worth), the same passes through
  `engine.backward` with an optimizer step after each (untimed), as `flexrl bench update`'s zero3 way.
Each is timed `repeats` times after `warmups` passes (the first records ZeRO-3's trace, the second
is the first on it); the best is its figure. One more pass runs under cProfile to count DeepSpeed's
calls per micro-batch (`COUNTED`): module hooks, fetches, releases, all-gathers, gradient reductions.
Every setting's loss must equal the bare module's (relative 1e-5: the same computation).
On CPU the engine runs fp32 with torch's AdamW and without `offload_optimizer` (a CPU run has nothing to
offload to); the hooks' Python work does not depend on the dtype.
"""

from __future__ import annotations

import cProfile
import copy
import dataclasses
import pstats
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from flexrl_ds.bench import zero3_settings
from flexrl_ds.bench.rollout_bench import SHAPES
from flexrl_ds.bench.update_bench import (UpdateBenchConfig, bench_batches, bench_samples, flexrl_pass, one_rank_sp,
                                          trainer_module_options)
from flexrl_ds.config.flexrl_config import load_run_config
from flexrl_ds.models import zero3
from flexrl_ds.models.flex_model import FlexUlyssesLM
from flexrl_ds.models.loading import load_model, model_without_weights, ordinary_token_bound
from flexrl_ds.models.sample_data import write_scoring_dataset
from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model
from flexrl_ds.parallel.launch import init_distributed, one_rank_env
from flexrl_ds.sp.attention import FlexUlyssesAttention

SETTINGS: dict[str, dict[str, float]] = {
    "shipped": {},
    "persist-1d": {"stage3_param_persistence_threshold": 1e5},
    "persist-all": {"stage3_param_persistence_threshold": float(zero3_settings.ALL)},
    "granularity-2m": {"stage3_module_granularity_threshold": 2e6},
    "granularity-7m": {"stage3_module_granularity_threshold": 7e6},
    "leaves-2m": {zero3_settings.LEAVES_KEY: 2e6},
    "leaves-7m": {zero3_settings.LEAVES_KEY: 7e6},
    "leaves-layers": {zero3_settings.LAYER_LEAVES_KEY: 1},
    "prefetch-0": {"stage3_prefetch_bucket_size": 0},
    "prefetch-2e8": {"stage3_prefetch_bucket_size": 2e8},
    "max-live-1e8": {"stage3_max_live_parameters": 1e8},
    "reuse-0": {"stage3_max_reuse_distance": 0},
    "reuse-1e9": {"stage3_max_reuse_distance": 1e9},
    "persist-1d+granularity-7m": {"stage3_param_persistence_threshold": 1e5,
                                  "stage3_module_granularity_threshold": 7e6},
    "persist-1d+leaves-layers": {"stage3_param_persistence_threshold": 1e5, zero3_settings.LAYER_LEAVES_KEY: 1},
    "persist-all+leaves-layers": {"stage3_param_persistence_threshold": float(zero3_settings.ALL),
                                  zero3_settings.LAYER_LEAVES_KEY: 1},
}
"""Named `zero_optimization` overrides, written for the real shape. `shipped` is the run file's block
alone, every module with its own hooks; the trainer adds `leaves-layers` to it by default
(`flexrl.trainer.zero3_leaf_layers`, since 2026-12-06). 3B's numbers: 1e5 keeps the
1-D parameters whole, 2e6 makes the vision blocks and the decoder's attention modules leaves, 7e6
each decoder layer and the whole vision tower; 2e8 elements are ~2.6 decoder layers."""
COUNTED = ("_pre_forward_module_hook", "_post_forward_module_hook", "_pre_backward_module_hook",
           "_post_backward_module_hook", "fetch_sub_module", "release_sub_module", "__all_gather_params_",
           "free_param", "reduce_partition_and_remove_grads")
"""DeepSpeed functions whose calls per micro-batch the bench counts (cProfile, by function name): the
four module hooks, the coordinator's fetches and releases, its gathers (each of a set of parameters:
the module's and those prefetched with it), the parameters released (their gathered data freed), the
gradients reduced into their partitions."""
STRUCTURE_WIDTHS: dict[str, Any] = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                        intermediate_size=128, vision_hidden_size=32, vision_num_heads=2,
                                        vocab_size=None)
"""The tiny widths the structure model takes over the shape's (depths, geometry and classes kept)."""


@dataclass(frozen=True)
class HostBenchConfig:
    work_dir: str
    """Where the tiny model, the real shape's config and the scoring set are written."""
    run_config: str = "ds_configs/grpo_vl3b_1xh100.json"
    """The run's JSON: its `zero_optimization` is each setting's base, its `flexrl.sp` cuts the micro-batches."""
    shape: str = "3b"
    """bench/rollout_bench.py SHAPES: whose module tree the tiny model copies."""
    settings: tuple[str, ...] = tuple(SETTINGS)
    """Which of `SETTINGS` to time."""
    prompts: int = 8
    """Records of the generated scoring set (the hooks' cost per micro-batch hardly depends on the tokens:
    a small batch keeps the bare compute, and the noise with it, small)."""
    samples_per_prompt: int = 2
    response_length: int = 64
    repeats: int = 5
    warmups: int = 2
    seed: int = 0
    checkpointing: bool | None = None
    """Activation checkpointing; None: the run config's `flexrl.trainer.activation_checkpointing`."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.settings) - set(SETTINGS))
        if unknown or not self.settings:
            raise ValueError(f"--settings: {', '.join(unknown) or 'none given'}: choose from {', '.join(SETTINGS)}")
        if self.shape not in SHAPES or self.shape == "tiny":
            raise ValueError(f"--shape: one of {', '.join(k for k in SHAPES if k != 'tiny')}, got {self.shape!r}")
        for name in ("prompts", "samples_per_prompt", "response_length", "repeats", "warmups"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")


@dataclass
class HostBenchRow:
    setting: str
    zero: dict[str, Any]
    """The tiny model's `zero_optimization` overrides (translated from the setting's)."""
    seconds: float = 0.0
    """Best forward+backward over all micro-batches."""
    loss: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)
    """`COUNTED` calls over all micro-batches (one pass)."""
    leaves: int = 0
    """ZeRO-3 leaf modules in the engine (as DeepSpeed set them)."""
    persistent: int = 0
    """Persistent parameter tensors in the engine."""
    real_persistent_bytes: int = 0
    """The real shape's persistent parameters in bf16: kept whole on every rank."""
    real_leaf_bytes: int = 0
    """The real shape's largest leaf module in bf16: gathered whole at once."""
    error: str = ""
    """What the engine raised, if it could not run the passes (the setting breaks this model)."""


@dataclass
class HostBenchResult:
    micro_batches: int
    tokens: int
    modules: int
    parameters: int
    bare_seconds: float = 0.0
    bare_loss: float = 0.0
    rows: list[HostBenchRow] = field(default_factory=list)


def structure_models(config: HostBenchConfig) -> tuple[Path, Any]:
    """(the tiny model's directory, the real shape's model on the meta device)."""

    shape = SHAPES[config.shape]
    real_dir = make_tiny_model(TinyModelConfig(out_dir=str(Path(config.work_dir) / f"real-{config.shape}"),
                                               **shape), weights=False)
    overrides = {**shape.get("vision_overrides", {}), "intermediate_size": 2 * STRUCTURE_WIDTHS["vision_hidden_size"]}
    tiny = TinyModelConfig(out_dir=str(Path(config.work_dir) / f"tiny-{config.shape}"), seed=config.seed,
                           **{**shape, **STRUCTURE_WIDTHS, "vision_overrides": overrides})
    return make_tiny_model(tiny), model_without_weights(str(real_dir))


def engine_config(run_deepspeed: dict, zero_overrides: dict) -> dict:
    """The run's DeepSpeed JSON for a CPU engine: fp32, torch's AdamW, no optimizer offload, the
    overrides over its `zero_optimization`, a fixed schedule length."""

    config = zero3.with_schedule_length(copy.deepcopy(run_deepspeed), 100)
    config.pop("bf16", None)
    config["optimizer"] = {**config["optimizer"], "params": {**config["optimizer"]["params"], "torch_adam": True}}
    zero = {key: value for key, value in config["zero_optimization"].items() if key != "offload_optimizer"}
    config["zero_optimization"] = {**zero, **zero_overrides}
    return config


def count_calls(profile: cProfile.Profile) -> dict[str, int]:
    """Calls of each `COUNTED` DeepSpeed function in `profile`."""
    calls = dict.fromkeys(COUNTED, 0)
    for (filename, _, function), (_, total_calls, *_) in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        if "deepspeed" in filename and function in calls:
            calls[function] += total_calls
    return calls


def run_host_bench(config: HostBenchConfig, progress: Callable[[str], None] = print) -> HostBenchResult:
    """The bare module, then every asked setting's engine (module docstring)."""

    context = init_distributed(one_rank_env("flexrl bench zero3-host"))
    bench = HostBench(config)
    result = bench.result
    progress(f"bench zero3-host: {config.shape}'s module tree at tiny widths ({result.modules} modules, "
             f"{result.parameters} parameter tensors), {len(bench.samples)} samples, {result.tokens} tokens in "
             f"{result.micro_batches} micro-batch(es), on {context.device}")
    result.bare_seconds, result.bare_loss = bench.bare()
    progress(f"bench zero3-host: bare: {result.bare_seconds:.3f} s, loss {result.bare_loss:.6f}")
    for name in config.settings:
        row = bench.setting(name)
        result.rows.append(row)
        if row.error:
            progress(f"bench zero3-host: {name}: fails ({row.leaves} leaves): {row.error}")
            continue
        if abs(row.loss - result.bare_loss) > 1e-5 * abs(result.bare_loss):
            raise AssertionError(f"setting {name}: loss {row.loss} != the bare module's {result.bare_loss}")
        progress(f"bench zero3-host: {name}: {row.seconds:.3f} s (+{row.seconds - result.bare_seconds:.3f} over bare), "
                 f"{row.leaves} leaves, {row.persistent} persistent, calls {row.calls}")
    return result


def best_of(work: Callable[[], Any], between: Callable[[], Any], repeats: int,
            warmups: int) -> tuple[float, float, Any]:
    """(best seconds of `work`, best seconds of `between`, what the first `work` returned) over `repeats`
    runs after `warmups`, `between` after each `work` (an optimizer step)."""
    times: list[float] = []
    between_times: list[float] = []
    first: Any = None
    for index in range(warmups + repeats):
        started = time.perf_counter()
        value = work()
        middle = time.perf_counter()
        between()
        if index == 0:
            first = value
        if index >= warmups:
            times.append(middle - started)
            between_times.append(time.perf_counter() - middle)
    return min(times), min(between_times), first


class HostBench:
    """The models, samples and micro-batches every way of one bench run shares."""

    def __init__(self, config: HostBenchConfig):

        self.config = config
        self.run = load_run_config(config.run_config)
        self.model_dir, self.real = structure_models(config)
        data = write_scoring_dataset(Path(config.work_dir) / "data", num_records=config.prompts, seed=config.seed)
        model = load_model(str(self.model_dir))
        self.samples = bench_samples(UpdateBenchConfig(str(self.model_dir), str(data), config.run_config,
                                                       response_length=config.response_length,
                                                       samples_per_prompt=config.samples_per_prompt, seed=config.seed),
                                     ordinary_token_bound(model.config))
        self.batches = bench_batches(model, str(self.model_dir), self.samples, one_rank_sp(self.run.flexrl.sp))
        self.result = HostBenchResult(len(self.batches), sum(s.length for s in self.samples.values()),
                                      len(list(model.modules())), len(list(model.parameters())))
        self.options = {**trainer_module_options(self.run),
                        "attention": FlexUlyssesAttention(overlap=self.run.flexrl.sp.overlap)}
        self.checkpointing = (self.run.flexrl.trainer.activation_checkpointing if config.checkpointing is None
                              else config.checkpointing)

    def file_zero(self) -> dict:
        """The run config's `stage3_*` settings: every setting's base (`shipped` is this alone)."""
        return {k: v for k, v in self.run.deepspeed["zero_optimization"].items() if k.startswith("stage3_")}

    def model(self, leaves: tuple[str, ...] = ()):
        """A fresh copy of the tiny model in training mode, `leaves` marked, checkpointed as asked."""

        model = load_model(str(self.model_dir))
        _mark_leaves(model, list(leaves))
        if self.checkpointing:
            zero3.enable_activation_checkpointing(model)
        return model.train()

    def timed(self, work: Callable[[], float], between: Callable[[], Any] = lambda: None) -> tuple[float, float]:
        """(best seconds of `repeats` runs of `work` after `warmups`, the first run's loss: before any
        optimizer step); `between` after each run (an optimizer step)."""
        seconds, _, first = best_of(work, between, self.config.repeats, self.config.warmups)
        return seconds, first

    def bare(self) -> tuple[float, float]:
        """The bare module's (seconds, loss)."""

        bare = FlexUlyssesLM(self.model(), **self.options)
        return self.timed(flexrl_pass(bare, self.batches, self.samples, lambda value: value.backward(),
                                      lambda: bare.zero_grad(set_to_none=True)))

    def setting(self, name: str) -> HostBenchRow:
        """One setting's engine: timed, counted, its leaves and persistent parameters read back."""
        from deepspeed.utils import z3_leaf_module  # lazy: DeepSpeed's import takes seconds; the CLI imports this file


        zero, leaves = zero3_settings.small_zero_settings(self.real, {**self.file_zero(), **SETTINGS[name]},
                                                          self.model())
        engine = zero3.build_engine(self.model(tuple(leaves)), engine_config(self.run.deepspeed, zero), **self.options)
        row = HostBenchRow(name, zero, leaves=sum(1 for module in engine.module.modules() if z3_leaf_module(module)),
                           persistent=sum(1 for p in engine.module.parameters() if getattr(p, "ds_persist", False)))
        try:
            work = flexrl_pass(engine, self.batches, self.samples, engine.backward, lambda: None,
                               engine.set_gradient_accumulation_boundary)
            row.seconds, row.loss = self.timed(work, engine.step)
            profile = cProfile.Profile()
            profile.runcall(work)
            engine.step()
            row.calls = count_calls(profile)
        except (RuntimeError, AssertionError, TypeError, ValueError) as error:  # DeepSpeed's, from inside the passes
            row.error = f"{type(error).__name__}: {error}"[:200]
        finally:
            engine.destroy()
            torch.distributed.barrier()
        row.real_persistent_bytes, row.real_leaf_bytes = real_memory(self.real, {
            **zero3_settings.DEEPSPEED_DEFAULTS, **self.run.deepspeed["zero_optimization"], **SETTINGS[name]})
        return row


def real_memory(real, zero: dict) -> tuple[int, int]:
    """(bf16 bytes of the real shape's persistent parameters, of its largest leaf module) under `zero`."""
    persistent = zero3.persistent_elements(real, int(float(zero["stage3_param_persistence_threshold"])))
    leaves = zero3_settings.leaf_names(real, int(float(zero.get("stage3_module_granularity_threshold",
                                                                zero.get(zero3_settings.LEAVES_KEY, 0)))))
    if zero.get(zero3_settings.LAYER_LEAVES_KEY):
        leaves = zero3_settings.layer_leaf_names(real)
    return 2 * persistent, 2 * zero3_settings.leaf_elements(real, leaves)


def _mark_leaves(model, names: list[str]) -> None:
    """Mark the modules `names` of `model` as ZeRO-3 leaves (as a granularity threshold would)."""
    from deepspeed.utils import set_z3_leaf_module  # lazy: as in `HostBench.setting`

    modules = dict(model.named_modules())
    for name in names:
        set_z3_leaf_module(modules[name], True)


def format_result(result: HostBenchResult) -> str:
    """A table per setting: seconds and over-bare seconds per micro-batch, calls per micro-batch, memory."""
    per = max(1, result.micro_batches)
    lines = [f"bare module: {result.bare_seconds / per:.3f} s per micro-batch ({result.micro_batches} micro-batch(es), "
             f"{result.tokens} tokens, {result.modules} modules, {result.parameters} parameter tensors)",
             f"{'setting':<28}{'s/mb':>8}{'hooks s/mb':>11}{'hooks':>7}{'fetch':>7}{'release':>8}{'gathers':>8}"
             f"{'freed':>7}{'grad red.':>10}{'leaves':>7}{'persist':>8}{'persist GiB':>12}{'leaf GiB':>9}"]
    for row in result.rows:
        if row.error:
            lines.append(f"{row.setting:<28}fails ({row.leaves} leaves): {row.error[:90]}")
            continue
        calls = {key: value / per for key, value in row.calls.items()}
        hooks = sum(calls[key] for key in COUNTED[:4])
        lines.append(f"{row.setting:<28}{row.seconds / per:>8.3f}{(row.seconds - result.bare_seconds) / per:>11.3f}"
                     f"{hooks:>7.0f}{calls['fetch_sub_module']:>7.0f}{calls['release_sub_module']:>8.0f}"
                     f"{calls['__all_gather_params_']:>8.0f}{calls['free_param']:>7.0f}{calls['reduce_partition_and_remove_grads']:>10.0f}"
                     f"{row.leaves:>7}{row.persistent:>8}{row.real_persistent_bytes / 2**30:>12.2f}"
                     f"{row.real_leaf_bytes / 2**30:>9.2f}")
    lines.append("hooks: DeepSpeed's pre/post forward/backward module functions; persist GiB and leaf GiB: the real "
                 "shape's persistent parameters (whole on every rank) and largest leaf (gathered at once), bf16")
    return "\n".join(lines)


def result_json(result: HostBenchResult) -> dict:
    return dataclasses.asdict(result)
