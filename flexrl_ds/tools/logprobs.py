"""`flexrl logprobs`: the reference / old-policy pass of GRPO as a tool, on the trainer's runtime.

Flow (the planner sees sequence lengths before any forward):
1. read the records and encode them: tokens + vision items. `--loader shadow` (the training path):
   the run's data controller (runtime/data_controller.py: a `LoaderService` actor with the
   `ProxyLoader` and its preprocessing actors) probes and decodes the media; this process (the
   parent) holds only metadata, tokens and prompt keys (flexrl_ds/tools/shadow_step.py).
   `--loader local` (the reference): this process decodes everything (flexrl_ds/models/processing.py);
2. plan the step with the FlexUlysses planner over `--nproc` ranks (`--plan-out` writes it);
3. run the step on a worker group of N ranks (runtime/: a `RayWorkerGroup` of rank actors for
   shadow, a `ProcessWorkerGroup` of forked processes for local; gloo on CPU, NCCL on GPU), started
   before the step is known so that the ranks' start overlaps its loading: each rank runs the model
   once over its local tokens with FlexUlysses attention and balanced vision encoding
   (flexrl_ds/tools/logprob_worker.py). With shadow each rank pulls only its vision units' pixels
   with the controller's `PixelSource` (flexrl_ds/runtime/rank_pixels.py; a slice whose actor died
   is re-routed through the loader service); with local every rank receives every sample, pixels
   included;
4. the parent assembles every rank's pieces and writes one line per record:
   {"id", "input_ids", "response_start", "logprobs"}, logprobs[i] = log p(input_ids[response_start+i]).

With `--loader local --nproc 1` everything runs in this process (no process group); shadow always
starts its ranks, so pixels never enter this process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import json
import logging
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flexrl_ds.common.output_files import output_file
from flexrl_ds.families import family_of_dir
from flexrl_ds.config.flexrl_config import load_run_config
from flexrl_ds.models.processing import encode_records
from flexrl_ds.parallel import device as device_mod
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.planning.plan import Workload, load_plan, validate_plan
from flexrl_ds.planning.planner import plan_step
from flexrl_ds.runtime.process_workers import ProcessWorkerGroup
from flexrl_ds.runtime.worker_group import RayWorkerGroup
from flexrl_ds.tools import logprob_worker, shadow_step
from flexrl_ds.tools.logprob_worker import PRELOAD, LogprobWorker, RankSetup

logger = logging.getLogger(__package__)

# Ray is imported only by the shadow loader's functions: `--loader local` (and `auto` where Ray is
# not importable) runs without it.

DTYPES = ("float32", "bfloat16", "float64")
LOADERS = ("auto", "shadow", "local")


@dataclass(frozen=True)
class LogprobsConfig:
    """Options of `flexrl logprobs`."""

    model_dir: str
    """HF model directory (weights, tokenizer, processor files)."""
    data_path: str
    """Records (.jsonl / .parquet) with prompt, media and a `response` to score."""
    out_path: str
    """Output JSONL, one line per record, in input order."""
    num_procs: int = 1
    """Processes (ranks) of the single SP domain."""
    p_max: int | None = None
    """Largest Ulysses degree; None: num_procs."""
    plan_out: str | None = None
    """If set, the plan used is written here (docs/PLAN_SCHEMA.md)."""
    dtype: str = "float32"
    """Model dtype."""
    timeout_s: float = 600.0
    """Collective timeout of the worker process group."""
    plan_in: str | None = None
    """If set, run this plan file instead of planning (validated against the records and --nproc)."""
    response_key: str = "response"
    """Record field holding the text to score (e.g. "answer" for datasets without responses)."""
    loader: str = "auto"
    """Where pixels come from: shadow (Ray preprocessing actors; ranks pull their own slices), local
    (this process decodes every record and sends all samples to every rank), auto (shadow when Ray is
    importable, else local)."""
    num_actors: int | None = None
    """Preprocessing actors per Ray node (shadow); None: the run config's `flexrl.data.pool`."""
    cpus_per_actor: float | None = None
    """Ray CPUs reserved per preprocessing actor (shadow; fractions allowed); None: `flexrl.data.pool`."""
    run_config: str | None = None
    """DeepSpeed JSON whose `flexrl.data` section configures the shadow loader (None: defaults)."""

    def __post_init__(self) -> None:
        if self.num_procs < 1 or self.num_procs & (self.num_procs - 1):
            raise ValueError(f"--nproc must be a power of two >= 1, got {self.num_procs}")
        if self.p_max is not None and (self.p_max < 1 or self.p_max & (self.p_max - 1) or self.p_max > self.num_procs):
            raise ValueError(f"--p-max must be a power of two <= --nproc ({self.num_procs}), got {self.p_max}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.loader not in LOADERS:
            raise ValueError(f"--loader must be one of {LOADERS}, got {self.loader!r}")
        if self.loader == "shadow" and importlib.util.find_spec("ray") is None:
            raise ValueError("--loader shadow needs Ray (pip install ray), or use --loader local")
        if not Path(self.model_dir, "config.json").exists():
            raise ValueError(f"--model {self.model_dir}: no config.json there (make one with flexrl make-tiny-model)")

    @property
    def resolved_p_max(self) -> int:
        return self.p_max or self.num_procs

    @property
    def resolved_loader(self) -> str:
        if self.loader != "auto":
            return self.loader
        return "shadow" if importlib.util.find_spec("ray") is not None else "local"


def encode_dataset(model_dir: str, data_path: str, response_key: str = "response") -> dict[str, Any]:
    """EncodedSample per usable record id, in file order (bad records reported and skipped)."""
    return encode_records(model_dir, data_path, response_key=response_key)


def sp_settings(run_config: str | None, p_max: int) -> SPConfig:
    """`flexrl.sp` of `--config` (token cap, the log-prob passes' one where set, packing, cost model,
    calibration, oversize; defaults without one), with `--p-max` / `--nproc` deciding the largest
    degree and `overlap` on (the executor's). What this tool replaces or does without is named on
    stdout (`unused_sp_settings`)."""
    if run_config is None:
        return SPConfig(p_max=p_max)
    sp = load_run_config(run_config).flexrl.sp
    for line in unused_sp_settings(sp, p_max):
        logger.info(f"flexrl logprobs: {line} ({run_config})")
    return dataclasses.replace(sp.for_logprob_passes(), p_max=p_max, overlap=True)


def unused_sp_settings(sp: SPConfig, p_max: int) -> list[str]:
    """The `flexrl.sp` settings of a run config that `flexrl logprobs` replaces or does without."""
    lines = []
    if sp.p_max != p_max:
        lines.append(f"flexrl.sp.p_max = {sp.p_max} is replaced: --p-max / --nproc give {p_max}")
    if sp.domain_size is not None:
        lines.append(f"flexrl.sp.domain_size = {sp.domain_size} is not used: all processes are one SP domain")
    if not sp.overlap:
        lines.append("flexrl.sp.overlap = false is replaced: the passes overlap their all-to-alls, and the "
                     "plan is made for that (the log-probs are the same either way)")
    return lines


def plan_for_samples(model_dir: str, samples: dict[str, Any], num_procs: int, p_max: int,
                     sp: SPConfig | None = None):
    """The FlexUlysses planner's plan for these sequences over `num_procs` ranks (`sp`: the run
    config's `flexrl.sp`; None: defaults with `p_max`)."""
    sequences = tuple(sample.sequence_spec(seq_id) for seq_id, sample in samples.items())
    sp = sp or SPConfig(p_max=p_max)
    cost = load_cost_model(sp.cost_model or str(Path(model_dir) / "config.json"), sp.calibration,
                           device_name=device_mod.accelerator_name())
    return plan_step(Workload(sequences), num_procs, cost, sp).plan


def load_given_plan(path: str, samples: dict[str, Any], num_procs: int):
    """A plan file checked against the records and the number of processes."""
    plan = load_plan(path)
    if plan.world_size != num_procs:
        raise ValueError(f"--plan {path}: plan is for world_size {plan.world_size}, but --nproc is {num_procs}")
    validate_plan(plan, list(samples))
    return plan


@dataclass
class LogprobsReport:
    """What one `flexrl logprobs` run did."""

    summary: str
    """Two lines for the user: the output written, and the data the parent handled."""
    loader: str
    """The loader used (shadow or local)."""
    usage: DataUsage
    """Bytes through the parent, and pixels the ranks pulled themselves."""


def run_logprobs(config: LogprobsConfig) -> LogprobsReport:
    """Run the whole tool."""
    start = time.perf_counter()
    if Path(config.model_dir, "config.json").is_file():
        family_of_dir(config.model_dir)  # a family flexrl_ds cannot shard is refused before any rank starts
    if config.resolved_loader == "shadow":
        samples, results, usage, num_actors = _run_shadow(config)
    else:
        samples, results, usage = _run_local(config)
        num_actors = 0
    write_results(config.out_path, samples, results)
    elapsed = time.perf_counter() - start
    summary = (f"wrote log-probs of {len(results)} records to {config.out_path} ({elapsed:.1f} s, "
               f"{config.num_procs} ranks, loader {config.resolved_loader})\n" + usage.describe(num_actors))
    return LogprobsReport(summary, config.resolved_loader, usage)


def _run_local(config: LogprobsConfig):
    """This process decodes every record; the ranks (started first, loading the model meanwhile)
    receive every sample, pixels included."""
    if config.num_procs == 1:
        samples = encode_dataset(config.model_dir, config.data_path, config.response_key)
        return (samples, *_plan_and_run(config, samples, None))
    setup = RankSetup(config.model_dir, config.dtype, config.timeout_s)
    with ProcessWorkerGroup(LogprobWorker, config.num_procs, {"setup": setup}, name="flexrl logprobs ranks",
                            timeout_s=config.timeout_s, preload=PRELOAD) as ranks:
        samples = encode_dataset(config.model_dir, config.data_path, config.response_key)
        return (samples, *_plan_and_run(config, samples, ranks))


RANK_CPUS = 0.5
"""Ray CPUs reserved per rank actor of `--loader shadow` (the ranks' threads are not limited by it)."""
RANK_ENV = ("OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "FLEXRL_FORCE_CPU", "FLEXRL_DEBUG")
"""Environment variables of this process the rank actors get too."""


def _run_shadow(config: LogprobsConfig):
    """The parent path: metadata here, pixels on the preprocessing actors (inside the data
    controller's service), ranks (a Ray worker group) pull their own units. The ranks start
    (process group, model) while the actors probe and decode."""
    import ray  # lazy: Ray is optional for --loader local (see LogprobsConfig.resolved_loader)

    from flexrl_ds.runtime.data_controller import DataController  # lazy: imports Ray (optional, as above)
    from flexrl_ds.runtime.ray_session import connect_ray, num_alive_nodes  # lazy: imports Ray (as above)

    settings = shadow_step.ShadowSettings(num_actors_per_node=config.num_actors,
                                          num_cpus_per_actor=config.cpus_per_actor, timeout_s=config.timeout_s)
    data_config, encoder, records = shadow_step.shadow_inputs(config.model_dir, config.data_path,
                                                              config.response_key, settings, config.run_config)
    pool = data_config.pool
    started = time.perf_counter()
    started_ray = connect_ray(max(4, int(pool.cpus_per_node + config.num_procs * RANK_CPUS) + 2))
    with contextlib.ExitStack() as stack:
        if started_ray:
            stack.callback(ray.shutdown)
        joined = time.perf_counter()
        controller = DataController(records, data_config, config.timeout_s)
        stack.callback(controller.close)
        num_actors = pool.num_actors_per_node * num_alive_nodes()
        logger.info(f"Ray {'started' if started_ray else 'joined'} in {joined - started:.1f} s; {num_actors} "
                    f"preprocessing actors ready in {time.perf_counter() - joined:.1f} s")
        ranks, step = _start_ranks_while_loading(config, controller, encoder, stack)
        results, usage = _plan_and_run(config, step.samples, ranks, pixels=controller.pixels,
                                       step=step.step.step, prompt_keys=step.prompt_keys)
        stats = controller.stats()
        usage.num_rerouted = int(stats["num_rerouted"])
        if usage.num_rerouted:
            logger.warning(f"preprocessing actors died after the step was decoded: the ranks' fetches re-routed "
                           f"{usage.num_rerouted} prompts to live actors through the loader service")
        usage.controller_bytes += int(stats["bytes_through_controller"])
        return step.samples, results, usage, num_actors


def _start_ranks_while_loading(config: LogprobsConfig, controller, encoder, stack: contextlib.ExitStack):
    """(rank group, `ShadowStep`): the rank actors start while the controller loads the step; the
    group is shut down when `stack` closes (also if loading fails)."""
    from concurrent.futures import ThreadPoolExecutor

    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logprob-ranks")
    starting = executor.submit(_rank_group, config)

    def stop_ranks() -> None:
        executor.shutdown(wait=True)
        if starting.exception() is None:
            starting.result().shutdown()

    stack.callback(stop_ranks)
    loading = time.perf_counter()
    step = shadow_step.load_step(controller, encoder, config.response_key, config.data_path)
    logger.info(f"probed and decoded {len(step.samples)} records on the actors in "
                f"{time.perf_counter() - loading:.1f} s; pixels stay in their object stores")
    return starting.result(), step


def _rank_group(config: LogprobsConfig):
    """`config.num_procs` rank actors (one GPU each when the cluster has enough GPUs)."""
    import os

    import ray  # lazy: Ray is optional for --loader local

    use_gpus = (os.environ.get("FLEXRL_FORCE_CPU", "0") != "1"
                and ray.cluster_resources().get("GPU", 0) >= config.num_procs)
    env = {name: os.environ[name] for name in RANK_ENV if name in os.environ}
    return RayWorkerGroup(LogprobWorker, config.num_procs, {"setup": RankSetup(config.model_dir, config.dtype,
                                                                               config.timeout_s)},
                          num_cpus_per_rank=RANK_CPUS, num_gpus_per_rank=1.0 if use_gpus else 0.0,
                          name="flexrl logprobs ranks", timeout_s=config.timeout_s, env=env)


@dataclass
class DataUsage:
    """Input data the parent (controller) handled, and pixels the ranks pulled themselves."""

    controller_bytes: int = 0
    """Serialized bytes of records, metadata, tokens, object references and rank jobs through the parent."""
    controller_pixel_bytes: int = 0
    """Pixel bytes among them (0 with the shadow loader)."""
    num_rank_jobs: int = 0
    """Spawned ranks the job was sent to (0: ran in this process)."""
    rank_pixel_bytes: int = 0
    """Pixel bytes the ranks pulled straight from the preprocessing actors (shadow)."""
    rank_wait_s: float = 0.0
    """Longest time a rank waited for its pixels after its vision units were known (shadow)."""
    num_rerouted: int = 0
    """Prompts re-routed to live preprocessing actors after theirs died (shadow)."""

    def describe(self, num_actors: int) -> str:
        import resource

        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
        line = (f"parent data: {_size(self.controller_bytes)} "
                f"(pixels {_size(self.controller_pixel_bytes)}"
                + (f", job sent to {self.num_rank_jobs} ranks)" if self.num_rank_jobs else ", ranks in this process)"))
        if num_actors:
            line += (f"; ranks pulled {_size(self.rank_pixel_bytes)} of pixels from {num_actors} preprocessing "
                     f"actors (longest wait {self.rank_wait_s:.1f} s)")
        return line + f"; parent peak RSS {_size(peak_kib * 1024)}"


def _size(num_bytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


def pixel_bytes_in(samples: dict[str, Any]) -> int:
    """Bytes of pixel tensors held by encoded samples (placeholders hold none)."""
    return sum(item.pixel_values.nbytes for sample in samples.values() for item in sample.items
               if isinstance(item.pixel_values, torch.Tensor))


def _plan_and_run(config: LogprobsConfig, samples: dict[str, Any], ranks,
                  **pixels: Any) -> tuple[dict[str, list[float]], DataUsage]:
    """Plan the step, run it on `ranks` (a started worker group of `LogprobWorker`s; None: here,
    for local --nproc 1), assemble the log-probs. `pixels`: the job's `pixels`, `step` and
    `prompt_keys` (shadow: the ranks pull their units)."""
    if config.plan_in:
        plan = load_given_plan(config.plan_in, samples, config.num_procs)
    else:
        plan = plan_for_samples(config.model_dir, samples, config.num_procs, config.resolved_p_max,
                                sp_settings(config.run_config, config.resolved_p_max))
    if config.plan_out:
        plan.save(config.plan_out)
    logger.info(f"planned {len(samples)} sequences ({sum(s.length for s in samples.values())} tokens) on "
                f"{config.num_procs} ranks: degrees {sorted({p.degree for p in plan.packs})}, {len(plan.packs)} packs")
    job = logprob_worker.LogprobJob(model_dir=config.model_dir, dtype=config.dtype, plan_json=plan.to_json(),
                                    samples=samples, timeout_s=config.timeout_s, **pixels)
    if config.run_config:  # the run's LM-head chunk budget; else LogprobJob's default
        job.logprob_chunk_bytes = load_run_config(config.run_config).flexrl.sp.logprob_chunk_bytes
    usage = DataUsage(controller_pixel_bytes=pixel_bytes_in(samples))
    if ranks is None:
        stats: dict[str, float] = {}
        per_rank = [(logprob_worker.rank_logprobs(job, rank=0, group_tree=None, stats=stats), stats)]
        usage.controller_bytes = len(pickle.dumps(samples))
    else:
        per_rank = ranks.run(LogprobWorker.logprobs, job)
        usage.num_rank_jobs = config.num_procs
        usage.controller_bytes = len(pickle.dumps(job)) * config.num_procs
    usage.rank_pixel_bytes = int(sum(stats.get("pixel_bytes", 0) for _, stats in per_rank))
    usage.rank_wait_s = max((stats.get("wait_s", 0.0) for _, stats in per_rank), default=0.0)
    return logprob_worker.assemble(samples, [pieces for pieces, _ in per_rank]), usage


def write_results(path: str, samples: dict[str, Any], logprobs: dict[str, list[float]]) -> None:
    lines = []
    for seq_id, sample in samples.items():
        lines.append(json.dumps({"id": seq_id, "input_ids": sample.input_ids.tolist(),
                                 "response_start": sample.response_start, "logprobs": logprobs[seq_id]}))
    output_file(path).write_text("\n".join(lines) + "\n")
