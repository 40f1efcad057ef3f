"""The trainer's update step's own host cost beyond the ZeRO-3 engine, per micro-batch, on one rank (issue 40, item 2).

`flexrl bench update` on one H100 found `train_step` (models/policy_update.py) ~1.4 s slower than the
engine's forward+backward plus its optimizer step. This bench takes `flexrl bench zero3-host`'s model
(the 3B module tree at tiny widths: its compute is small, the host's work shows) and samples, one
engine as the trainer builds it (the run file's ZeRO-3 settings and `flexrl.trainer.zero3_leaf_layers`),
and times on the CPU, per micro-batch:
- `zero3`: the engine's forward + a plain response-NLL loss + `engine.backward` (`flexrl_pass`), and
  `engine.step()` after each pass, as `flexrl bench update`'s zero3 way;
- `grpo`: `train_step` over the same micro-batches (`grpo_pass`: forward with entropy,
  `rank_grpo_loss`, backward, then `engine.step()`);
- the parts of `train_step` that `zero3` lacks, each alone on one forward's outputs: the forward's
  entropy (a forward with it less one without), `_pieces_index`, the rows gathers, `grpo_loss`, the
  whole of `rank_grpo_loss`, `set_gradient_accumulation_boundary`;
- the host syncs (`SyncCounter`: `.item()`, `.tolist()`, `float()` / `int()` / `bool()` of a tensor,
  `.cpu()`, `.numpy()`) of one `rank_grpo_loss` and of one `train_step` per micro-batch: on a GPU each
  drains the queue the host had built ahead.
Each time is the best of `repeats` after `warmups`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from flexrl_ds.bench import zero3_settings
from flexrl_ds.bench.update_bench import flexrl_pass, grpo_pass
from flexrl_ds.bench.zero3_host_bench import HostBench, HostBenchConfig, best_of, engine_config
from flexrl_ds.models import policy_update as pu
from flexrl_ds.models import zero3
from flexrl_ds.parallel.launch import init_distributed, one_rank_env
from flexrl_ds.parallel.profiling import SyncCounter
from flexrl_ds.rl.losses import grpo_loss

@dataclass
class StepCostResult:
    micro_batches: int
    tokens: int
    seconds: dict[str, float] = field(default_factory=dict)
    """Per micro-batch: each way's and each part's best host seconds."""
    syncs: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per micro-batch: the host syncs of `rank_grpo_loss` and of `train_step`, by method."""


def best_seconds(work: Callable[[], Any], repeats: int, warmups: int) -> float:
    """Best seconds of `work` over `repeats` runs after `warmups`."""
    return best_of(work, lambda: None, repeats, warmups)[0]


def run_step_cost_bench(config: HostBenchConfig, progress: Callable[[str], None] = print) -> StepCostResult:
    """The trainer's engine's `zero3` and `grpo` ways and the parts of `train_step` (module docstring)."""
    init_distributed(one_rank_env("flexrl bench step-cost"))
    bench = HostBench(config)
    trainer_zero = {**bench.file_zero(), zero3_settings.LAYER_LEAVES_KEY: bench.run.flexrl.trainer.zero3_leaf_layers}
    zero, leaves = zero3_settings.small_zero_settings(bench.real, trainer_zero, bench.model())
    engine = zero3.build_engine(bench.model(tuple(leaves)), engine_config(bench.run.deepspeed, zero), **bench.options)
    per = len(bench.batches)
    result = StepCostResult(per, bench.result.tokens)
    rl = bench.run.flexrl.rl

    def timed(work: Callable[[], Any], count: int = per) -> float:
        return best_seconds(work, config.repeats, config.warmups) / count

    zero3_run = flexrl_pass(engine, bench.batches, bench.samples, engine.backward, lambda: None,
                            engine.set_gradient_accumulation_boundary)
    passes, steps, _ = best_of(zero3_run, engine.step, config.repeats, config.warmups)
    result.seconds["zero3 forward+backward"], result.seconds["engine.step"] = passes / per, steps / per
    grpo_run = grpo_pass(engine, bench.batches, bench.samples, rl, config.seed)
    result.seconds["train_step"] = timed(grpo_run)
    result.seconds.update(_parts(engine, bench, rl, timed))
    result.syncs = _syncs(engine, bench, rl, grpo_run, zero3_run)
    engine.destroy()
    for name, seconds in result.seconds.items():
        progress(f"bench step-cost: {name}: {seconds:.4f} s per micro-batch")
    progress(f"bench step-cost: syncs per micro-batch: {result.syncs}")
    return result


def _loss_inputs(engine, bench: HostBench, rl):
    """The first micro-batch's `grpo_pass` inputs, its `Denominators`, and a forward's outputs with entropy."""
    batch = bench.batches[0]
    with torch.no_grad():
        current = engine(batch).logprobs.float().cpu()
    advantages = pu.local_response_values(batch, {name: 0.5 for name in bench.samples})
    denoms = pu.denominators({n: s.length - s.response_start for n, s in bench.samples.items()})
    outputs = engine(batch, with_entropy=True, entropy_grad=rl.entropy_coef > 0)
    return pu.UpdateInputs(batch, current, current, advantages), denoms, outputs


def _parts(engine, bench: HostBench, rl, timed) -> dict[str, float]:
    """Per micro-batch seconds of the parts of `train_step` that the zero3 way lacks (forwards without backward)."""
    inputs, denoms, outputs = _loss_inputs(engine, bench, rl)
    batch = inputs.batch
    index, valid, _ = pu._pieces_index(batch)
    mask = valid & batch.response_mask[index]
    logprobs = outputs.logprobs.float()[index]

    def loss_only() -> None:
        grpo_loss(logprobs, inputs.old_logprobs[index], inputs.advantages[index], mask, rl,
                  ref_logprobs_SL=inputs.ref_logprobs[index], denominator=denoms.num_tokens,
                  kl_denominator=denoms.num_tokens, norm_length=rl.loss_norm_length)

    def rows() -> None:
        for values in (outputs.logprobs, inputs.old_logprobs, inputs.ref_logprobs, inputs.advantages, outputs.entropy):
            values.float()[index]

    def forward(with_entropy: bool) -> Callable[[], Any]:
        return lambda: [engine(b, with_entropy=with_entropy, entropy_grad=rl.entropy_coef > 0) for b in bench.batches]

    entropy = timed(forward(True)) - timed(forward(False))
    return {"entropy (forward with it - without)": entropy, "_pieces_index": timed(lambda: pu._pieces_index(batch), 1),
            "rows gathers": timed(rows, 1), "grpo_loss": timed(loss_only, 1),
            "rank_grpo_loss (all)": timed(lambda: pu.rank_grpo_loss(
                outputs, batch, inputs.old_logprobs, inputs.ref_logprobs, inputs.advantages, rl, denoms, 1), 1),
            "set_gradient_accumulation_boundary": timed(lambda: engine.set_gradient_accumulation_boundary(False), 1)}


def _syncs(engine, bench: HostBench, rl, grpo_run, zero3_run) -> dict[str, dict[str, float]]:
    """Per micro-batch host syncs, by method: one `rank_grpo_loss`, the engine's forward, backward and
    step alone, the zero3 way (pass + step; its loss read once per micro-batch), `train_step`."""
    inputs, denoms, outputs = _loss_inputs(engine, bench, rl)
    with SyncCounter() as loss_counter:
        pu.rank_grpo_loss(outputs, inputs.batch, inputs.old_logprobs, inputs.ref_logprobs, inputs.advantages, rl,
                          denoms, 1)
    with SyncCounter() as forward_counter:
        outputs = [engine(batch) for batch in bench.batches]
    with SyncCounter() as backward_counter:
        for index, out in enumerate(outputs):
            engine.set_gradient_accumulation_boundary(index == len(outputs) - 1)
            engine.backward(out.logprobs.sum() + out.zero)
    with SyncCounter() as engine_step_counter:
        engine.step()
    with SyncCounter() as zero3_counter:
        zero3_run()
        engine.step()
    with SyncCounter() as step_counter:
        grpo_run()
    per = len(bench.batches)
    return {"rank_grpo_loss": dict(loss_counter.calls),
            **{f"engine {name}": {key: count / per for key, count in counter.calls.items()} for name, counter in
               (("forward", forward_counter), ("backward", backward_counter), ("step", engine_step_counter))},
            "zero3 pass + engine.step": {name: count / per for name, count in zero3_counter.calls.items()},
            "train_step": {name: count / per for name, count in step_counter.calls.items()}}

