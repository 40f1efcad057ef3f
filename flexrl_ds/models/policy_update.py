"""The GRPO policy update on one rank of a FlexUlysses step under DeepSpeed ZeRO-3.

A rank holds pieces of several sequences (`RankLayout.segments()`: one contiguous piece per sequence
it touches). Everything here works on per-local-token tensors `(local,)` in the batch's local order:
the policy's log-probs (and entropies) from `FlexUlyssesLM`, and the old-policy / reference log-probs
and advantages the caller placed there (`local_response_values` spreads per-sequence response values).

`rank_grpo_loss` gathers the local tokens into one row per piece and calls the pure
`rl/losses.grpo_loss` with the mini-batch's GLOBAL denominators (`Denominators`: the response token
count for `token_mean`; the sequence count, plus each sequence's FULL response token count from the
batch, for `sequence_mean`), so the sum over ranks of the local losses is the single-process loss.
The entropy bonus is reduced the same way (`token_mean`: loss -= entropy_coef x mean token entropy).
The loss handed to `engine.backward` is multiplied by the data-parallel world size because DeepSpeed
averages gradients over ranks (as `zero3.flex_step_loss` does), and carries the forward's zero term.

`RankStats` are sums over this rank's tokens (shares of the global means, token counts): `reduce_stats`
all-reduces them into the step's metrics. `rank_loss_and_sums` keeps them as one device tensor (no
host sync); `train_step` adds its micro-batches' up there and reads them once per step.
`train_step` = forward + loss + `engine.backward` + `engine.step()`, with the global gradient norm
before clipping as DeepSpeed reports it; a mini-batch cut into micro-batches
(planning/micro_batches.py) accumulates their gradients first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from flexrl_ds.models.flex_model import StepBatch, TokenOutputs
from flexrl_ds.models.moe import router_aux_term
from flexrl_ds.models.zero3 import data_parallel_size
from flexrl_ds.parallel.device import to_device
from flexrl_ds.parallel.profiling import region
from flexrl_ds.rl.config import GRPOConfig
from flexrl_ds.rl.losses import STAT_SUMS, grpo_loss, reduce_masked, sequence_log_ratio_sums


@dataclass(frozen=True)
class Denominators:
    """The mini-batch's global loss denominators (all ranks, all SP domains)."""

    num_tokens: int
    """Response tokens of every sequence of the mini-batch (token_mean)."""
    num_sequences: int
    """Sequences of the mini-batch with at least one response token (sequence_mean and the token sums)."""
    sequence_ids: tuple[str, ...] = ()
    """Every sequence of the mini-batch, sorted: the index all ranks share for gspo's per-sequence sums."""

    def for_reduction(self, reduction: str, norm_length: int | None = None) -> int:
        value = self.num_tokens if reduction == "token_mean" else self.num_sequences
        if value < 1:
            raise ValueError(f"the mini-batch has no response tokens ({reduction} denominator is {value})")
        if reduction == "seq_mean_token_sum_norm":
            assert norm_length is not None, "flexrl.rl.loss_norm_length is resolved at launch"
            value *= norm_length
        return value


def denominators(response_tokens: Mapping[str, int]) -> Denominators:
    """Denominators from every sequence's response token count (the WHOLE mini-batch: pass the
    counts of all SP domains' sequences, e.g. `{id: s.length - s.response_start}`)."""
    return Denominators(num_tokens=sum(response_tokens.values()),
                        num_sequences=sum(1 for count in response_tokens.values() if count > 0),
                        sequence_ids=tuple(sorted(response_tokens)))


def local_response_values(batch: StepBatch, values: Mapping[str, Any], fill: float = 0.0) -> torch.Tensor:
    """(local,) float32: `values[seq]` (a float, or one value per response token of the sequence) at
    the local positions that predict those response tokens; `fill` elsewhere."""
    lengths = {s: n for pack in batch.layout.packs for s, n in zip(pack.sequence_ids, pack.sequence_lengths)}
    full = {}
    for seq_id, length in lengths.items():
        count = batch.response_tokens[seq_id]
        row = torch.full((length,), float(fill), dtype=torch.float32)
        value = values[seq_id]
        row[length - 1 - count:length - 1] = torch.as_tensor(value, dtype=torch.float32)
        full[seq_id] = row
    if not full:
        return torch.zeros(0, dtype=torch.float32)
    return batch.layout.slice_tokens(full)


def _pieces_index(batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """(P, Lmax) local indices of each piece's tokens, their validity, and the pieces' sequence ids."""
    segments = batch.layout.segments()
    longest = max((hi - lo for _, lo, hi, _ in segments), default=0)
    steps = torch.arange(longest)
    starts = torch.tensor([local for *_, local in segments], dtype=torch.long)
    sizes = torch.tensor([hi - lo for _, lo, hi, _ in segments], dtype=torch.long)
    valid = steps[None, :] < sizes[:, None]
    index = torch.where(valid, starts[:, None] + steps[None, :], torch.zeros_like(valid, dtype=torch.long))
    return index, valid, [seq_id for seq_id, *_ in segments]


@dataclass
class RankStats:
    """Sums over this rank's tokens; `reduce_stats` adds them over ranks into the step's metrics."""

    loss: float = 0.0
    """This rank's share of the step loss (pg + kl_coef * kl - entropy_coef * entropy)."""
    pg_loss: float = 0.0
    """Share of the clipped policy-gradient loss."""
    kl: float = 0.0
    """Share of the reference KL term (before init_kl_coef)."""
    entropy: float = 0.0
    """Share of the reduced token entropy (0 where the forward computed none)."""
    clip_count: float = 0.0
    """Response tokens whose clipped branch was taken."""
    dual_clip_count: float = 0.0
    """Response tokens whose loss the dual clip capped."""
    approx_kl_sum: float = 0.0
    """Sum over response tokens of the k3 estimate of KL(old || policy)."""
    num_tokens: float = 0.0
    """Response tokens on this rank."""
    router_aux_loss: float = 0.0
    """Share of a sparse decoder's router auxiliary loss (models/moe.py; the shares sum to its value)."""
    router_passes: float = 0.0
    """Forwards that reported router statistics (0: a dense model, no `router_aux_loss` metric)."""

    @classmethod
    def from_sums(cls, sums: torch.Tensor) -> "RankStats":
        """From `rank_loss_and_sums`' tensor (the fields in order): one wait for the device."""
        return cls(*sums.tolist())

    def __add__(self, other: "RankStats") -> "RankStats":
        return RankStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(RankStats)})


def sequence_mean_log_ratios(log_ratio_sums_P: torch.Tensor, seq_ids: Sequence[str], full_counts_P: torch.Tensor,
                             denoms: Denominators) -> torch.Tensor:
    """(P,) gspo's mean log-ratio of each piece's WHOLE sequence: the pieces' sums added up per
    sequence over every rank (a differentiable all-reduce: each rank's loss reaches the tokens other
    ranks hold), / the sequence's response tokens. Collective over the default group."""
    index = {seq_id: position for position, seq_id in enumerate(denoms.sequence_ids)}
    where_P = to_device(torch.tensor([index[seq_id] for seq_id in seq_ids], dtype=torch.long), log_ratio_sums_P.device)
    totals = torch.zeros(len(index), dtype=log_ratio_sums_P.dtype, device=log_ratio_sums_P.device)
    totals = totals.index_add(0, where_P, log_ratio_sums_P)
    if dist.is_initialized():
        totals = dist_nn.all_reduce(totals)
    return totals[where_P] / full_counts_P.clamp_min(1)


def rank_grpo_loss(outputs: TokenOutputs, batch: StepBatch, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, RankStats]:
    """`rank_loss_and_sums` with the statistics read back as a `RankStats` (one wait for the device)."""
    loss, sums = rank_loss_and_sums(outputs, batch, *args, **kwargs)
    return loss, RankStats.from_sums(sums)


def rank_loss_and_sums(outputs: TokenOutputs, batch: StepBatch, old_logprobs: torch.Tensor | None,
                       ref_logprobs: torch.Tensor | None, advantages: torch.Tensor, config: GRPOConfig,
                       denoms: Denominators, dp_world_size: int, is_weights: torch.Tensor | None = None,
                       kl_coef: float | None = None, router=None,
                       router_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss for `engine.backward`, this rank's summed statistics as a detached float64 device tensor in
    `RankStats`' field order: no host sync, so that a step reads its micro-batches' sums once); per-token
    inputs are (local,).
    `old_logprobs` None: the old policy is the current one (its detached log-probs; ratio 1).
    `router`: the forward's `moe.RouterStats` (a sparse decoder; collective over all ranks), else None;
    its auxiliary loss enters (and is reported) times `router_weight`: 1 / the optimizer step's
    micro-batches, so that the step's is their mean (as transformers' Trainer and Megatron-LM
    accumulate it: the load-balancing loss is a product of two sums, not a sum over micro-batches)."""
    logprobs = outputs.logprobs
    device = logprobs.device
    index, valid, seq_ids = _pieces_index(batch)
    index, valid = to_device(index, device), to_device(valid, device)
    mask_PL = valid & to_device(batch.response_mask, device)[index]

    def rows(values: torch.Tensor | None) -> torch.Tensor | None:
        return None if values is None else to_device(values, device).float()[index]

    logprobs_PL = rows(logprobs)
    old_PL = logprobs_PL.detach() if old_logprobs is None else rows(old_logprobs)
    full_counts = to_device(torch.tensor([batch.response_tokens[s] for s in seq_ids], dtype=torch.float32), device)
    reduce_args = dict(denominator=denoms.for_reduction(config.loss_reduction, config.loss_norm_length),
                       sequence_num_tokens_S=full_counts if config.loss_reduction == "sequence_mean" else None)
    sequence_log_ratio = None
    if config.policy_loss == "gspo":
        sequence_log_ratio = sequence_mean_log_ratios(sequence_log_ratio_sums(logprobs_PL, old_PL, mask_PL),
                                                      seq_ids, full_counts, denoms)
    loss, stats = grpo_loss(logprobs_PL, old_PL, rows(advantages), mask_PL, config, ref_logprobs_SL=rows(ref_logprobs),
                            **reduce_args, is_weights_SL=rows(is_weights), kl_coef=kl_coef,
                            kl_denominator=denoms.num_tokens, norm_length=config.loss_norm_length,
                            sequence_log_ratio_S=sequence_log_ratio)
    entropy = torch.zeros((), device=device)
    if outputs.entropy is not None:
        if config.kl_entropy_reduction == "token_mean":
            reduce_args = dict(denominator=denoms.num_tokens)
        reduction = "token_mean" if config.kl_entropy_reduction == "token_mean" else config.loss_reduction
        entropy = reduce_masked(rows(outputs.entropy), mask_PL, reduction, **reduce_args)
        if config.entropy_coef > 0:  # otherwise a statistic only: no backward through it
            loss = loss - config.entropy_coef * entropy
    aux = router_weight * router_aux_term(router)[0] if router is not None else torch.zeros((), device=device)
    if config.router_aux_loss_coef > 0:
        loss = loss + config.router_aux_loss_coef * aux
    sums = dict(zip(STAT_SUMS, stats.sums.unbind()))
    values = {"loss": loss.detach(), "pg_loss": sums["policy_loss"], "kl": sums["kl_loss"], "entropy": entropy.detach(),
              "clip_count": sums["clip_count"], "dual_clip_count": sums["dual_clip_count"],
              "approx_kl_sum": sums["approx_kl_sum"], "num_tokens": sums["num_tokens"],
              "router_aux_loss": aux.detach(),
              "router_passes": torch.full((), float(router is not None), device=device)}  # a fill, not a copy
    summed = torch.stack([values[f.name].double() for f in fields(RankStats)])  # `RankStats.from_sums`' order
    return loss * dp_world_size + outputs.zero, summed


def reduce_stats(stats: RankStats, group=None, device=None) -> dict[str, float]:
    """The step's metrics from every rank's `RankStats` (collective over `group`): loss, pg_loss, kl,
    entropy, clip_frac, dual_clip_frac, approx_kl, num_tokens. `device`: where the collective runs (the rank's device:
    NCCL reduces device tensors only)."""
    names = [f.name for f in fields(RankStats)]
    values = torch.tensor([getattr(stats, name) for name in names], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(values, group=group)
    total = dict(zip(names, values.tolist()))
    tokens = max(total["num_tokens"], 1.0)
    metrics = {"loss": total["loss"], "pg_loss": total["pg_loss"], "kl": total["kl"], "entropy": total["entropy"],
               "clip_frac": total["clip_count"] / tokens, "dual_clip_frac": total["dual_clip_count"] / tokens,
               "approx_kl": total["approx_kl_sum"] / tokens,
               "num_tokens": total["num_tokens"]}
    if total["router_passes"] > 0:  # a sparse MoE decoder: its micro-batches' auxiliary losses, averaged
        metrics["router_aux_loss"] = total["router_aux_loss"]
    return metrics


def no_grad_logprobs(engine, batch: StepBatch) -> torch.Tensor:
    """(local,) fp32 target log-probs without grad (old-policy or reference pass; collective)."""
    with torch.no_grad():
        return engine(batch).logprobs


@dataclass
class TrainStepResult:
    """One optimizer step of one rank."""

    stats: RankStats
    """This rank's sums (all-reduce with `reduce_stats`)."""
    grad_norm: float
    """Global gradient norm before clipping (`engine.get_global_grad_norm()`; the same on all ranks)."""
    lr: float = float("nan")
    """The learning rate this optimizer step used (the first parameter group's; the scheduler's value)."""
    logprobs: list[torch.Tensor] | None = None
    """Per micro-batch, the forward's detached (local,) log-probs on the host: asked for when the
    update skipped the old-policy pass (they are then the old policy's)."""

    def as_dict(self) -> dict[str, float]:
        return dict(asdict(self.stats), grad_norm=self.grad_norm, lr=self.lr)


@dataclass
class UpdateInputs:
    """One micro-batch of an update: its StepBatch and the (local,) values placed on it
    (`local_response_values`)."""

    batch: StepBatch
    old_logprobs: torch.Tensor | None
    """None: the old policy is the current one (the old-policy pass was skipped)."""
    ref_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    is_weights: torch.Tensor | None = None
    """The TIS weights (rl/correction.py); None: none."""


def train_step(engine, micro_batches: Sequence[UpdateInputs], config: GRPOConfig,
               denoms: Denominators, kl_coef: float | None = None, keep_logprobs: bool = False) -> TrainStepResult:
    """Per micro-batch: forward (with the tokens' entropy: in the loss when entropy_coef > 0, else
    only logged, computed without a graph), GRPO loss over the mini-batch's denominators,
    `engine.backward`; the gradients add
    up (DeepSpeed's accumulation boundary is set on the last micro-batch only), then one
    `engine.step()`. The statistics are the micro-batches' sums, kept on the device and read once
    after the step: no host sync per micro-batch (on a GPU each would drain the queue the host built ahead).

    Every backward must reach every parameter (the forward's zero term and the vision tower's
    placeholder see to it): with an offloaded optimizer, ZeRO-3 copies a parameter's accumulated
    gradient to the host only on the boundary's backward. On bf16 engines DeepSpeed adds the
    micro-batches' gradients in bf16 unless the JSON sets `data_types.grad_accum_dtype` to fp32.
    `kl_coef`: the adaptive controller's KL coefficient (None: config.init_kl_coef); `keep_logprobs`:
    return each micro-batch's detached log-probs (`TrainStepResult.logprobs`)."""
    if not micro_batches:
        raise ValueError("train_step: no micro-batch")
    total: torch.Tensor | None = None
    kept = []
    for index, inputs in enumerate(micro_batches):
        engine.set_gradient_accumulation_boundary(index == len(micro_batches) - 1)
        with region("forward"):
            outputs = engine(inputs.batch, with_entropy=True, entropy_grad=config.entropy_coef > 0)
        if keep_logprobs:  # to the host after the step: a copy here would wait for the forward
            kept.append(outputs.logprobs.detach().float())
        with region("loss"):
            loss, sums = rank_loss_and_sums(outputs, inputs.batch, inputs.old_logprobs, inputs.ref_logprobs,
                                             inputs.advantages, config, denoms, data_parallel_size(engine),
                                             is_weights=inputs.is_weights, kl_coef=kl_coef,
                                             router=engine.module.last_router_stats,
                                             router_weight=1.0 / len(micro_batches))
        with region("backward"):
            engine.backward(loss)
        total = sums if total is None else total + sums
    lr = engine.get_lr()[0] if hasattr(engine, "get_lr") else float("nan")
    with region("optimizer_step"):
        engine.step()
    norm = engine.get_global_grad_norm()
    assert total is not None
    return TrainStepResult(RankStats.from_sums(total), float(norm) if norm is not None else float("nan"), float(lr),
                           [logprobs.cpu() for logprobs in kept] if keep_logprobs else None)
