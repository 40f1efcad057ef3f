"""`flexrl logprobs`: the reference / old-policy pass of GRPO as a tool.

Flow (the planner sees sequence lengths before any forward):
1. read the records and encode them: tokens + vision items. `--loader shadow` (the training path):
   Ray preprocessing actors probe and decode the media, this process (the controller) holds only
   metadata, tokens and object references (flexrl_ds/runtime/shadow_session.py). `--loader local` (the
   reference): this process decodes everything (flexrl_ds/models/processing.py);
2. plan the step with the FlexUlysses planner over `--nproc` ranks (`--plan-out` writes it);
3. spawn N processes (gloo on CPU, NCCL on GPU) that each run the model once over their local tokens
   with FlexUlysses attention and balanced vision encoding (flexrl_ds/tools/logprob_worker.py). With
   shadow each rank pulls only its vision units' pixels from the actors (flexrl_ds/runtime/rank_pixels.py);
   with local every rank receives every sample, pixels included;
4. rank 0 gathers every rank's pieces and writes one line per record:
   {"id", "input_ids", "response_start", "logprobs"}, logprobs[i] = log p(input_ids[response_start+i]).

With `--loader local --nproc 1` everything runs in this process (no process group); shadow always
spawns its ranks, so pixels never enter this process.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    """If set, the plan used is written here (plan-schema.md)."""
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
    from flexrl_ds.models.processing import encode_records

    return encode_records(model_dir, data_path, response_key=response_key)


def plan_for_samples(model_dir: str, samples: dict[str, Any], num_procs: int, p_max: int):
    """The FlexUlysses planner's plan for these sequences over `num_procs` ranks."""
    from flexrl_ds.planning.config import SPConfig
    from flexrl_ds.planning.cost_model import load_cost_model
    from flexrl_ds.planning.plan import SequenceSpec, Workload
    from flexrl_ds.planning.planner import plan_step

    sequences = tuple(
        SequenceSpec(id=seq_id, tokens=s.length, vision_tokens=sum(i.num_tokens() for i in s.items),
                     images=sum(1 for i in s.items if i.kind == "image"),
                     frames=sum(i.grid_thw[0] * 2 for i in s.items if i.kind == "video"))
        for seq_id, s in samples.items())
    cost = load_cost_model(str(Path(model_dir) / "config.json"))
    return plan_step(Workload(sequences), num_procs, cost, SPConfig(p_max=p_max)).plan


def load_given_plan(path: str, samples: dict[str, Any], num_procs: int):
    """A plan file checked against the records and the number of processes."""
    from flexrl_ds.planning.plan import load_plan, validate_plan

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
    from flexrl_ds.tools.logprob_worker import RankProcesses, RankSetup

    if config.num_procs == 1:
        samples = encode_dataset(config.model_dir, config.data_path, config.response_key)
        return (samples, *_plan_and_run(config, samples, None, None))
    with RankProcesses(RankSetup(config.model_dir, config.dtype, config.timeout_s), config.num_procs) as ranks:
        samples = encode_dataset(config.model_dir, config.data_path, config.response_key)
        return (samples, *_plan_and_run(config, samples, None, ranks))


def _run_shadow(config: LogprobsConfig):
    """The controller path: metadata here, pixels on the actors, ranks pull their own units. The
    ranks start (process group, model, Ray) while the actors probe and decode."""
    from flexrl_ds.tools.logprob_worker import RankProcesses, RankSetup
    from flexrl_ds.runtime.shadow_session import ShadowSession, ShadowSettings

    settings = ShadowSettings(num_actors_per_node=config.num_actors, num_cpus_per_actor=config.cpus_per_actor,
                              timeout_s=config.timeout_s)
    data_config = None
    if config.run_config:
        from flexrl_ds.config.flexrl_config import load_run_config

        data_config = load_run_config(config.run_config).flexrl.data
    with ShadowSession(config.model_dir, config.data_path, config.response_key, settings, data_config) as session:
        setup = RankSetup(config.model_dir, config.dtype, config.timeout_s, *session.ray_address())
        with RankProcesses(setup, config.num_procs) as ranks:
            loading = time.perf_counter()
            step = session.load_step()
            print(f"probed and decoded {len(step.samples)} records on the actors in "
                  f"{time.perf_counter() - loading:.1f} s; pixels stay in their object stores", flush=True)
            try:
                results, usage = _plan_and_run(config, step.samples, step.handle, ranks)
            except RuntimeError as error:  # a rank failed: retry once if actors died holding our slices
                rerouted = session.reroute_lost()
                if not rerouted:
                    raise
                print(f"a rank run failed after preprocessing actors died ({str(error).splitlines()[0][:120]}); "
                      f"re-routed {rerouted} prompts to live actors, running the ranks again", file=sys.stderr)
                results, usage = _plan_and_run(config, step.samples, step.handle, None)
        usage.controller_bytes += session.controller_bytes
        return step.samples, results, usage, len(session.pool.alive)


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
    import torch

    return sum(item.pixel_values.nbytes for sample in samples.values() for item in sample.items
               if isinstance(item.pixel_values, torch.Tensor))


def _plan_and_run(config: LogprobsConfig, samples: dict[str, Any], shadow,
                  ranks) -> tuple[dict[str, list[float]], DataUsage]:
    """Plan the step, run it on `ranks` (started `RankProcesses`; None: spawn new ones; or here for
    local --nproc 1), assemble the log-probs."""
    from flexrl_ds.tools import logprob_worker

    if config.plan_in:
        plan = load_given_plan(config.plan_in, samples, config.num_procs)
    else:
        plan = plan_for_samples(config.model_dir, samples, config.num_procs, config.resolved_p_max)
    if config.plan_out:
        plan.save(config.plan_out)
    print(f"planned {len(samples)} sequences ({sum(s.length for s in samples.values())} tokens) on "
          f"{config.num_procs} ranks: degrees {sorted({p.degree for p in plan.packs})}, {len(plan.packs)} packs",
          flush=True)
    job = logprob_worker.LogprobJob(model_dir=config.model_dir, dtype=config.dtype, plan_json=plan.to_json(),
                                    samples=samples, timeout_s=config.timeout_s, shadow=shadow)
    usage = DataUsage(controller_pixel_bytes=pixel_bytes_in(samples))
    if config.num_procs == 1 and shadow is None:
        stats: dict[str, float] = {}
        per_rank = [(logprob_worker.rank_logprobs(job, rank=0, group_tree=None, stats=stats), stats)]
        usage.controller_bytes = len(pickle.dumps(samples))
    else:
        per_rank = ranks.run(job) if ranks is not None else logprob_worker.spawn(job, config.num_procs)
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
    Path(path).write_text("\n".join(lines) + "\n")
