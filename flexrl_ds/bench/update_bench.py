"""`flexrl bench update`: where a policy update's time goes on one device, against plain transformers.

The same samples (each record's prompt with its media, then `response_length` random response
tokens; `samples_per_prompt` copies of a prompt share its media, as a GRPO step's samples do), the
same weights, one forward and backward of the loss -(sum of the response tokens' log-probs) / their
number, timed in up to six ways (the best of `repeats` after one warm-up each):
- `hf`: transformers alone, one sample at a time (batch 1, sdpa: its vision tower's windows one by
  one), the gradients adding up: the naive baseline;
- `hf_batched`: transformers alone as a careful user writes it (bench/hf_baseline.py): samples
  sorted by length in right-padded micro-batches of at most `hf_batch_tokens` padded tokens, sdpa,
  the loss through lm_head in checkpointed chunks (activation checkpointing as the other ways:
  `--checkpointing`); its model TFLOP/s count the real tokens only, so padding shows as time;
- `flexrl`: `FlexUlyssesLM` on one rank (the planner's packs under the run config's `flexrl.sp`,
  cut into micro-batches under its token cap, as the trainer plans them; varlen attention in both
  towers; a prompt's media encoded once per micro-batch), no DeepSpeed;
- `zero3`: the same module in a DeepSpeed ZeRO-3 engine built from the run config's JSON (what
  the trainer runs), `engine.backward`;
- `zero3_step`: that engine's optimizer step alone;
- `logprob`: that engine's forward without grad, as each of the trainer's inference passes (old
  policy, reference) runs it, in micro-batches under `logprob_max_tokens_per_rank` where set
  (timed before any optimizer step: its loss is comparable too);
- `grpo`: the trainer's update itself (models/policy_update.train_step: forward with the tokens'
  entropy, the GRPO loss of the run config's `flexrl.rl` against the engine's own log-probs as the
  old and reference ones and random advantages, backward, optimizer step).
With `profile_dir`, one more run of every way asked under torch.profiler after its timed ones,
each into its own table (`<profile_dir>/<way>.txt`; zero3's with its optimizer step), the regions
splitting its time into vision tower, decoder, lm_head, loss, backward and optimizer step
(bench/update_profile.py).
Each reports seconds, model TFLOP/s (models/flops.py: the language model and the vision tower as
each way encodes it) and, on a GPU with a known peak, MFU; and, but for grpo, its loss, the same
for all (a check that they compute the same thing, up to the dtype's rounding). For hf_batched and
flexrl, the vision tower alone over the same micro-batches' media too (`vision_seconds`, forward and
backward: per sample with transformers' attention, against each prompt's media once per micro-batch
with the trainer's), so that each way's time splits into the tower's and the rest.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from flexrl_ds.bench.hf_baseline import hf_batched_pass, media_groups, padded_micro_batches, vision_alone_pass
from flexrl_ds.bench.update_profile import profile_run
from flexrl_ds.families import family_of
from flexrl_ds.common.output_files import output_file
from flexrl_ds.config.flexrl_config import load_run_config
from flexrl_ds.models import zero3
from flexrl_ds.models.flex_model import FlexUlyssesLM, build_step_batch, positions_fn, reference_logprobs
from flexrl_ds.models.flops import (DecoderShape, VisionShape, encoded_grids, peak_bf16_flops, training_forward_flops,
                                    vision_flops)
from flexrl_ds.models.loading import load_model, ordinary_token_bound
from flexrl_ds.models.policy_update import UpdateInputs, denominators, local_response_values, train_step
from flexrl_ds.models.processing import encode_records
from flexrl_ds.parallel import device as device_mod
from flexrl_ds.parallel.profiling import region
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.planning.micro_batches import plan_micro_batches
from flexrl_ds.planning.plan import Workload
from flexrl_ds.parallel.launch import init_distributed, one_rank_env
from flexrl_ds.sp import flash_attention_backend
from flexrl_ds.sp.attention import FlexUlyssesAttention
from flexrl_ds.trainer.memory_check import memory_inputs
from flexrl_ds.trainer.memory_estimate import host_memory
from flexrl_ds.trainer.validation import model_dtype


WAYS = ("hf", "hf_batched", "flexrl", "zero3", "logprob", "grpo")
HF_ATTENTIONS = ("sdpa", "flash_attention_2")


@dataclass(frozen=True)
class UpdateBenchConfig:
    model_dir: str
    data_path: str
    run_config: str
    """The run's JSON (its DeepSpeed part builds the engine; bf16 there means a bf16 model)."""
    response_length: int = 256
    samples_per_prompt: int = 4
    max_prompts: int | None = None
    repeats: int = 3
    activation_checkpointing: bool = False
    seed: int = 0
    ways: tuple[str, ...] = WAYS
    """Which of `WAYS` to time (zero3 includes zero3_step; zero3, logprob and grpo share one engine)."""
    profile_dir: str | None = None
    """Profile one more run of each way here, a table each (module docstring)."""
    profile_trace: bool = True
    """With `profile_dir`: each profile's trace too (`<way>.json.gz`; minutes to write for big runs)."""
    hf_batch_tokens: int = 16384
    """hf_batched: padded tokens (rows × longest row) of one micro-batch."""
    hf_attention: str = "sdpa"
    """The hf ways' attention implementation, as a transformers user picks it: "sdpa" (the default;
    the vision tower one call per window) or "flash_attention_2" (where flash-attn is installed: varlen
    in both towers, padding removed inside transformers)."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.ways) - set(WAYS))
        if unknown or not self.ways:
            raise ValueError(f"--ways: {', '.join(unknown) or 'none given'}: choose from {', '.join(WAYS)}")
        if self.response_length < 1 or self.samples_per_prompt < 1 or self.repeats < 1:
            raise ValueError("--response-length, --samples-per-prompt and --repeats must be at least 1")
        if self.hf_attention not in HF_ATTENTIONS:
            raise ValueError(f"--hf-attention: one of {', '.join(HF_ATTENTIONS)}, got {self.hf_attention!r}")
        if self.hf_batch_tokens < 1:
            raise ValueError(f"--hf-batch-tokens must be at least 1, got {self.hf_batch_tokens}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"--max-prompts must be at least 1, got {self.max_prompts}")


@dataclass
class UpdateBenchResult:
    device: str
    dtype: str
    num_samples: int
    tokens: int
    vision_patches: int
    """Patches the vision tower encodes once per prompt (flexrl, zero3); hf encodes them per sample."""
    packs: int = 0
    """Packs of the update's plans (all micro-batches)."""
    attention_calls: int = 0
    """Their attention calls per decoder layer (one rank: all degree 1, one per micro-batch)."""
    micro_batches: dict[str, int] = field(default_factory=dict)
    """Micro-batches of the update (flexrl, zero3, grpo) and of the logprob pass, as the trainer cuts them."""
    seconds: dict[str, float] = field(default_factory=dict)
    tflops: dict[str, float] = field(default_factory=dict)
    mfu: dict[str, float] = field(default_factory=dict)
    loss: dict[str, float] = field(default_factory=dict)
    vision_seconds: dict[str, float] = field(default_factory=dict)
    """The vision tower alone over a way's micro-batches' media, forward and backward (hf_batched, flexrl)."""
    pinned_host_gb: dict[str, float] = field(default_factory=dict)
    """After the engine ways, on a GPU: torch's pinned host memory at its `peak` since the process started
    (GiB; the hf ways' few pinned copies included) beside the memory estimate's pinned gradient buffers
    for this config and model (`estimate`, trainer/memory_estimate.py)."""


def bench_samples(config: UpdateBenchConfig, token_bound: int) -> dict[str, Any]:
    """EncodedSample per (record, copy): the record's prompt and media, random response tokens below
    `token_bound` (models.loading.ordinary_token_bound: no vision placeholders among them)."""
    # Every record has a prompt: encoded as the "response" to score, then replaced by random tokens.
    records = encode_records(config.model_dir, config.data_path, response_key="prompt")
    generator = torch.Generator().manual_seed(config.seed)
    samples = {}
    for record_id, sample in list(records.items())[:config.max_prompts]:
        items = [dataclasses.replace(item, share_key=f"{record_id}/{k}") for k, item in enumerate(sample.items)]
        for copy_index in range(config.samples_per_prompt):
            response = torch.randint(0, token_bound, (config.response_length,), generator=generator)
            input_ids = torch.cat([sample.input_ids[:sample.response_start], response])
            name = f"{record_id}#{copy_index}"
            samples[name] = dataclasses.replace(sample, id=name, input_ids=input_ids, items=items)
    return samples


def model_flops(model_config: Any, samples: dict[str, Any], shared_media: bool) -> float:
    """Forward FLOPs of all samples (language model, and the vision tower: each shared item once
    when `shared_media`, else once per sample)."""
    decoder = DecoderShape.from_config(model_config.get_text_config())
    total = sum(training_forward_flops(decoder, sample.length) for sample in samples.values())
    vision_config = getattr(model_config, "vision_config", None)
    if vision_config is None:
        return total
    vision = VisionShape.from_config(vision_config, family_of(model_config))
    return total + vision_flops(vision, encoded_grids(samples.items(), shared_media))


def batches_flops(model_config: Any, batches: list, samples: dict[str, Any]) -> float:
    """Forward FLOPs of the micro-batches: each prompt's media once per micro-batch holding its samples."""
    total = 0.0
    for batch in batches:
        names = {name for pack in batch.layout.packs for name in pack.sequence_ids}
        total += model_flops(model_config, {name: samples[name] for name in names}, shared_media=True)
    return total


def _timed(info, work: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds `work` took on the device, what it returned)."""
    device_mod.synchronize(info)
    start = time.perf_counter()
    value = work()
    device_mod.synchronize(info)
    return time.perf_counter() - start, value


def _best_time(info, run: Callable[[], float], repeats: int) -> tuple[float, float]:
    """(best seconds of `repeats` after a warm-up, the last loss)."""
    loss, times = run(), []
    for _ in range(repeats):
        seconds, loss = _timed(info, run)
        times.append(seconds)
    return min(times), loss


def _response_count(samples) -> int:
    return sum(s.length - s.response_start for s in samples.values())


def hf_pass(model, samples: dict[str, Any], temperature: float = 1.0) -> Callable[[], float]:
    """transformers alone: per sample, forward (batch 1), loss (logits over `temperature`), backward."""
    count = _response_count(samples)

    def run() -> float:
        model.zero_grad(set_to_none=True)
        total = 0.0
        for sample in samples.values():
            loss = -reference_logprobs(model, sample, temperature).float().sum() / count
            with region("backward"):
                loss.backward()
            total += float(loss.detach())
        return total
    return run


def flexrl_pass(module, batches, samples, backward: Callable, zero_grad: Callable,
                boundary: Callable[[bool], None] | None = None) -> Callable[[], float]:
    """FlexUlyssesLM on one rank (plain, or inside an engine, whose `boundary(is_last)` marks the
    last micro-batch's backward, as the trainer's does): per micro-batch, forward, loss, backward."""
    masks = [local_response_values(batch, {name: 1.0 for name in samples}) for batch in batches]
    count = _response_count(samples)

    def run() -> float:
        zero_grad()
        total = 0.0
        for index, (batch, mask) in enumerate(zip(batches, masks)):
            if boundary is not None:
                boundary(index == len(batches) - 1)
            outputs = module(batch)
            loss = -(outputs.logprobs.float() * mask.to(outputs.logprobs.device)).sum() / count + outputs.zero
            with region("backward"):
                backward(loss)
            total += float(loss.detach())
        return total
    return run


def _zero3_times(info, engine, run: Callable[[], float], repeats: int) -> tuple[float, float, float]:
    """(best forward+backward seconds, best optimizer step seconds, the first loss): each repeat
    runs both, so that every backward meets a step (ZeRO-3 reduces the gradients at each one)."""
    passes, steps, losses = [], [], []
    for _ in range(repeats + 1):  # the first is the warm-up
        seconds, loss = _timed(info, run)
        passes.append(seconds)
        losses.append(loss)
        steps.append(_timed(info, engine.step)[0])
    return min(passes[1:]), min(steps[1:]), losses[0]


def run_update_bench(config: UpdateBenchConfig, progress: Callable[[str], None] = print) -> UpdateBenchResult:
    """The ways of the module docstring asked in `config.ways`, in one process (a one-rank process group)."""
    context = init_distributed(one_rank_env("flexrl bench update"))
    run = load_run_config(config.run_config)
    dtype = model_dtype(run.deepspeed)
    model = load_model(config.model_dir, dtype).to(context.device)
    samples = bench_samples(config, ordinary_token_bound(model.config))
    result = UpdateBenchResult(device_mod.accelerator_name() or "cpu", dtype, len(samples),
                               sum(s.length for s in samples.values()),
                               sum(t * h * w for t, h, w in encoded_grids(samples.items())))
    progress(f"bench update: {result.num_samples} samples, {result.tokens} tokens, {result.vision_patches} vision "
             f"patches once per prompt, {dtype} on {result.device}")
    if config.activation_checkpointing:
        zero3.enable_activation_checkpointing(model)
    model.train()
    record = _Recorder(result, progress)
    _hf_ways(context.info, model, samples, run.flexrl.rollout.temperature, config, record)
    batches = bench_batches(model, config.model_dir, samples, one_rank_sp(run.flexrl.sp))
    logprob_batches = bench_batches(model, config.model_dir, samples, one_rank_sp(run.flexrl.sp.for_logprob_passes()))
    result.micro_batches = {"update": len(batches), "logprob": len(logprob_batches)}
    result.packs = sum(len(batch.layout.packs) for batch in batches)
    result.attention_calls = sum(len(batch.layout.attention_units) for batch in batches)
    progress(f"bench update: flexrl, zero3 and grpo run {len(batches)} micro-batch(es) (flexrl.sp.max_tokens_per_rank "
             f"{run.flexrl.sp.max_tokens_per_rank}), logprob {len(logprob_batches)}; {result.packs} packs (h_pack "
             f"{run.flexrl.sp.h_pack}, H_pack {run.flexrl.sp.H_pack}; None: the planner's defaults) in "
             f"{result.attention_calls} attention call(s) per layer")
    shared = 3 * batches_flops(model.config, batches, samples)
    module_options = trainer_module_options(run)
    if "flexrl" in config.ways:
        flex = FlexUlyssesLM(model, attention=FlexUlyssesAttention(overlap=run.flexrl.sp.overlap), **module_options)
        flex_run = flexrl_pass(flex, batches, samples, lambda value: value.backward(),
                               lambda: flex.zero_grad(set_to_none=True))
        seconds, loss = _best_time(context.info, flex_run, config.repeats)
        record("flexrl", seconds, loss, shared)
        record.profile(context.info, flex_run, "flexrl", config)
        if family_of(model.config).has_vision:  # the tower alone: each prompt's media once per micro-batch
            record.vision("flexrl", _best_time(context.info, vision_alone_pass(model, media_groups(
                model, [_one_sample_per_prompt(batch, samples) for batch in batches])), config.repeats)[0])
        model.zero_grad(set_to_none=True)
    if {"zero3", "logprob", "grpo"} & set(config.ways):
        # a schedule's "auto" length (the shipped configs'): any will do, the bench times steps, not their lr
        engine = zero3.build_engine(model, zero3.with_schedule_length(copy.deepcopy(run.deepspeed), 100), train=True,
                                    attention=FlexUlyssesAttention(overlap=run.flexrl.sp.overlap),
                                    leaf_layers=run.flexrl.trainer.zero3_leaf_layers, **module_options)
        _engine_ways(context.info, engine, (batches, logprob_batches), samples, run.flexrl.rl, config, record,
                     (shared / 3, batches_flops(model.config, logprob_batches, samples)))
        result.pinned_host_gb = pinned_host_figures(context.info, run, config.model_dir)
        if result.pinned_host_gb:
            progress(f"bench update: torch's pinned host memory peaked at {result.pinned_host_gb['peak']:.1f} GiB; "
                     f"the memory estimate's pinned gradient buffers: {result.pinned_host_gb['estimate']:.1f} GiB")
    return result


def pinned_host_figures(info, run, model_dir: str) -> dict[str, float]:
    """torch's pinned host memory peak (GiB) and what `flexrl estimate-memory` counts for the engine's
    pinned gradient buffers on one rank (its "gradient buffers" term); empty where torch keeps no
    statistics (CPU)."""
    held = device_mod.pinned_host_bytes(info)
    if not held["peak"]:
        return {}
    estimate = host_memory(memory_inputs(run, model_dir, num_ranks=1, device_bytes=1)).get("gradient buffers", 0)
    return {"peak": held["peak"] / 2**30, "estimate": estimate / 2**30}


def _hf_ways(info, model, samples, temperature: float, config: UpdateBenchConfig, record) -> None:
    """The plain-transformers ways asked in `config.ways`: hf (per sample) and hf_batched (padded
    micro-batches, bench/hf_baseline.py; profiled too with `profile_dir`)."""
    flops = 3 * model_flops(model.config, samples, shared_media=False)
    if {"hf", "hf_batched"} & set(config.ways) and config.hf_attention != "sdpa":  # sdpa: as loaded
        if not flash_attention_backend.flash_attn_available():
            raise ValueError(f"--hf-attention {config.hf_attention}: flash-attn is not installed here")
        model.set_attn_implementation(config.hf_attention)  # FlexUlyssesLM later sets its own
    if "hf" in config.ways:
        per_sample = hf_pass(model, samples, temperature)
        seconds, loss = _best_time(info, per_sample, config.repeats)
        record("hf", seconds, loss, flops)
        record.profile(info, per_sample, "hf", config, model=model)
        model.zero_grad(set_to_none=True)  # the next ways start without its gradients
    if "hf_batched" in config.ways:
        batched = hf_batched_pass(model, samples, temperature, config.hf_batch_tokens)
        seconds, loss = _best_time(info, batched, config.repeats)
        record("hf_batched", seconds, loss, flops)
        record.profile(info, batched, "hf_batched", config, model=model)
        if family_of(model.config).has_vision:  # the tower alone: per sample, transformers' attention
            names = padded_micro_batches({name: s.length for name, s in samples.items()}, config.hf_batch_tokens)
            groups = media_groups(model, [[samples[name] for name in batch] for batch in names])
            record.vision("hf_batched", _best_time(info, vision_alone_pass(model, groups), config.repeats)[0])
        model.zero_grad(set_to_none=True)


def _engine_ways(info, engine, both_batches, samples, rl_config, config: UpdateBenchConfig, record,
                 both_flops: tuple[float, float]):
    """The ways that run in the ZeRO-3 engine: logprob first (the weights untouched), zero3, grpo.
    Both pairs: (the update's, the logprob pass's)."""
    batches, logprob_batches = both_batches
    forward_flops, logprob_flops = both_flops
    if "logprob" in config.ways:
        no_grad = logprob_pass(engine, logprob_batches, samples)
        seconds, loss = _best_time(info, no_grad, config.repeats)
        record("logprob", seconds, loss, logprob_flops)
        record.profile(info, no_grad, "logprob", config)
    if "zero3" in config.ways:
        seconds, step_seconds, loss = _zero3_times(info, engine, flexrl_pass(
            engine, batches, samples, engine.backward, lambda: None, engine.set_gradient_accumulation_boundary),
            config.repeats)
        record("zero3", seconds, loss, 3 * forward_flops)
        record("zero3_step", step_seconds, None, 0.0)
        record.profile(info, flexrl_pass(engine, batches, samples, engine.backward, lambda: None,
                                         engine.set_gradient_accumulation_boundary), "zero3", config, step=engine.step)
    if "grpo" in config.ways:
        update = grpo_pass(engine, batches, samples, rl_config, config.seed)
        seconds, _ = _best_time(info, update, config.repeats)
        record("grpo", seconds, None, 3 * forward_flops)
        record.profile(info, update, "grpo", config)


def logprob_pass(engine, batches, samples) -> Callable[[], float]:
    """The engine's forward without grad, per micro-batch; the same loss as the other ways."""
    masks = [local_response_values(batch, {name: 1.0 for name in samples}) for batch in batches]
    count = _response_count(samples)

    def run() -> float:
        total = 0.0
        for batch, mask in zip(batches, masks):
            with torch.no_grad():
                logprobs = engine(batch).logprobs
            total += float(-(logprobs.float() * mask.to(logprobs.device)).sum() / count)
        return total
    return run


def grpo_pass(engine, batches, samples, rl_config, seed: int) -> Callable[[], float]:
    """The trainer's `train_step` over the micro-batches: the engine's current log-probs as old and
    reference, random advantages per sample (a GRPO step's shape, not its values)."""
    generator = torch.Generator().manual_seed(seed)
    advantages = {name: float(torch.randn((), generator=generator)) for name in samples}
    inputs = []
    for batch in batches:
        with torch.no_grad():
            current = engine(batch).logprobs.float().cpu()
        inputs.append(UpdateInputs(batch, current, current, local_response_values(batch, advantages)))
    totals = denominators({n: s.length - s.response_start for n, s in samples.items()})

    def run() -> float:
        return train_step(engine, inputs, rl_config, totals).stats.loss
    return run


def _one_sample_per_prompt(batch, samples: dict[str, Any]) -> list:
    """One sample of each prompt in `batch` (bench names are `<record>#<copy>`; copies share media)."""
    names = [name for pack in batch.layout.packs for name in pack.sequence_ids]
    first = {name.rsplit("#", 1)[0]: name for name in reversed(names)}
    return [samples[name] for name in first.values()]


def bench_batches(model, model_dir: str, samples: dict[str, Any], sp: SPConfig) -> list:
    """The StepBatch of each micro-batch the trainer would run these samples as on one rank under
    `sp` (planning/micro_batches.py: one unless they overflow `sp.max_tokens_per_rank`)."""
    cost = load_cost_model(sp.cost_model or str(Path(model_dir) / "config.json"), sp.calibration,
                           device_name=device_mod.accelerator_name())
    workload = Workload(tuple(sample.sequence_spec(name) for name, sample in samples.items()))
    batches = []
    for (result,) in plan_micro_batches([workload], 1, cost, sp):
        names = [name for pack in result.plan.packs for name in pack.sequences]
        batches.append(build_step_batch(model.config, result.plan, {n: samples[n] for n in names}, 0,
                                        positions=positions_fn(model)))
    return batches


class _Recorder:
    """Writes one way's figures into the result and says them."""

    def __init__(self, result: UpdateBenchResult, progress: Callable[[str], None]):
        self.result, self.progress = result, progress
        self.peak = peak_bf16_flops(device_mod.accelerator_name())

    def profile(self, info, run: Callable[[], Any], way: str, config: UpdateBenchConfig, **options) -> None:
        """With `config.profile_dir`: one more `run` of `way` profiled (bench/update_profile.py)."""
        if config.profile_dir:
            table = profile_run(info, run, config.profile_dir, way, config.profile_trace, **options)
            self.progress(f"bench update: {way} profiled: {table}")

    def vision(self, way: str, seconds: float) -> None:
        """The vision tower alone over `way`'s media: its seconds, and their share of the way's."""
        self.result.vision_seconds[way] = seconds
        share = f" ({seconds / self.result.seconds[way]:.0%} of the way's)" if self.result.seconds.get(way) else ""
        self.progress(f"bench update: {way}'s vision tower alone (forward+backward over its micro-batches' media): "
                      f"{seconds:.3f} s{share}")

    def __call__(self, way: str, seconds: float, loss: float | None, flops: float) -> None:
        result = self.result
        result.seconds[way] = seconds
        if loss is not None:
            result.loss[way] = loss
        result.tflops[way] = flops / seconds / 1e12 if flops else 0.0
        if self.peak and flops:
            result.mfu[way] = flops / seconds / self.peak
        self.progress(f"bench update: {way}: {seconds:.3f} s" + (f", loss {loss:.6f}" if loss is not None else "")
                      + (f", {result.tflops[way]:.3g} model TFLOP/s" if flops else "")
                      + (f", MFU {result.mfu[way]:.1%}" if way in result.mfu else ""))


def trainer_module_options(run) -> dict[str, Any]:
    """The module settings the trainer's policy takes from the run config (trainer/launch.py)."""
    return {"temperature": run.flexrl.rollout.temperature, "vision_attention": run.flexrl.trainer.vision_attention,
            "logits_chunk_bytes": run.flexrl.sp.logprob_chunk_bytes}


def one_rank_sp(sp: SPConfig) -> SPConfig:
    """The run's SP settings for one rank (degree 1, one domain); the token caps kept, and a sample
    over them an error whatever `oversize` says (dropped or cut samples would make the ways'
    losses differ; the trainer sets such prompts aside before their rollout)."""
    return dataclasses.replace(sp, p_max=1, domain_size=None, oversize="error")


def write_result(result: UpdateBenchResult, path: str | None) -> None:
    if path:
        with open(output_file(path), "w") as handle:
            json.dump(dataclasses.asdict(result), handle, indent=1)
