"""GRPO policy loss: token-level PPO-clip surrogate plus a KL penalty to the reference (pure torch).

Inputs are per-token tensors of shape (S, L): S sequences (samples) of L response positions, with
`response_mask_SL` marking real response tokens. Masked positions never reach the result, even if
they hold inf/NaN (padding log-probs), because they are selected away, not multiplied by 0.

Per token t, with ratio = exp(logprob - old_logprob) and advantage A:
    pg = -min(ratio * A, clip(ratio, 1 - eps_clip_low, 1 + eps_clip_high) * A)
    dual clip (c > 1, only where A < 0): pg = min(pg, -c * A)
    loss_t = pg + init_kl_coef * kl_estimator(logprob, ref_logprob)
and the step loss reduces loss_t with `reduce_masked`:
- `token_mean`: sum over every response token / denominator (default: this call's token count);
- `sequence_mean`: each sequence's token sum / its token count, summed / denominator (default:
  the number of sequences with at least one token; an all-masked sequence adds nothing).

Distributed use: no collectives here. Under ZeRO-3 + FlexUlysses each rank holds a slice of the
step's tokens; pass `denominator` = the GLOBAL token (or sequence) count, and for `sequence_mean`
`sequence_num_tokens_S` = each local sequence's FULL token count (a sequence may be split over an
SP group), then scale by the world size before `engine.backward` as `models/zero3.flex_step_loss`
does, so DeepSpeed's gradient averaging yields the single-process gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flexrl_ds.rl.config import KL_ESTIMATORS, LOSS_REDUCTIONS, GRPOConfig

MAX_LOG_RATIO = 20.0
"""Bound on a log-ratio before it is exponentiated (the ratio's above, k3's below): exp(20) ~ 5e8 is
finite in fp32, where exp beyond ~88.7 is inf and its gradient, times the 0 a clip gives it, NaN.
A token that far from its old or reference log-prob is clipped or clamped anyway; past the bound its
ratio (or k3 term) stops growing and passes no gradient."""


def approx_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str, clamp: float | None = None
) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs.

    With log_ratio = logprobs - ref_logprobs: k1 = log_ratio; k2 = log_ratio**2 / 2;
    k3 = exp(-log_ratio) - 1 + log_ratio (non-negative, unbiased; the exponent bounded by
    MAX_LOG_RATIO). `clamp` bounds the values.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator: {estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = log_ratio.square() / 2
    else:
        kl = torch.expm1(-log_ratio.clamp(min=-MAX_LOG_RATIO)) + log_ratio
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def reduce_masked(
    values_SL: torch.Tensor,
    mask_SL: torch.Tensor,
    reduction: str,
    denominator: float | None = None,
    sequence_num_tokens_S: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked reduction of per-token values to a scalar (see the module docstring)."""
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction: {reduction!r} is not one of {', '.join(LOSS_REDUCTIONS)}")
    if mask_SL.shape != values_SL.shape:
        raise ValueError(f"response_mask: shape {tuple(mask_SL.shape)} differs from {tuple(values_SL.shape)}")
    mask_SL = mask_SL.bool()
    sums_S = torch.where(mask_SL, values_SL, torch.zeros_like(values_SL)).sum(dim=-1)
    if reduction == "token_mean":
        numerator = sums_S.sum()
        local_count = int(mask_SL.sum())
    else:
        counts_S = mask_SL.sum(dim=-1) if sequence_num_tokens_S is None else sequence_num_tokens_S
        if counts_S.shape != sums_S.shape:
            raise ValueError(f"sequence_num_tokens: shape {tuple(counts_S.shape)} is not {tuple(sums_S.shape)}")
        numerator = (sums_S / counts_S.clamp_min(1).to(sums_S.dtype)).sum()
        local_count = int((mask_SL.sum(dim=-1) > 0).sum())
    if denominator is None:
        if local_count == 0:
            raise ValueError("response_mask: no response tokens; pass an explicit denominator")
        denominator = local_count
    if not denominator > 0:
        raise ValueError(f"denominator: must be positive, got {denominator}")
    return numerator / denominator


@dataclass
class PolicyLossStats:
    """Detached logging numbers of one `grpo_loss` call (means over its own response tokens)."""

    policy_loss: float
    """The clipped surrogate part of the loss, reduced like the loss."""
    kl_loss: float
    """The reference-KL part before weighting by init_kl_coef, reduced like the loss (0 if unused)."""
    clip_fraction: float
    """Fraction of tokens whose clipped branch was taken (the ratio left the clip range the wrong way)."""
    dual_clip_fraction: float
    """Fraction of tokens capped by the dual clip (0 when it is off)."""
    approx_kl: float
    """Mean k3 estimate of KL(old policy || policy): how far this update has moved."""
    mean_ratio: float
    """Mean of exp(logprob - old_logprob)."""
    num_tokens: int
    """Response tokens these means are over (weight them by this to combine ranks)."""


def _check_shapes(mask_SL: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != mask_SL.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} differs from response_mask {tuple(mask_SL.shape)}")


def clipped_surrogate(
    ratio_SL: torch.Tensor, advantages_SL: torch.Tensor, config: GRPOConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token PPO-clip loss, clipped-branch-taken mask, dual-clip-taken mask)."""
    unclipped_SL = ratio_SL * advantages_SL
    clipped_SL = ratio_SL.clamp(1 - config.eps_clip_low, 1 + config.eps_clip_high) * advantages_SL
    loss_SL = -torch.min(unclipped_SL, clipped_SL)
    clip_taken_SL = clipped_SL < unclipped_SL
    dual_taken_SL = torch.zeros_like(clip_taken_SL)
    if config.dual_clip is not None:
        cap_SL = -config.dual_clip * advantages_SL
        dual_taken_SL = (advantages_SL < 0) & (loss_SL > cap_SL)
        loss_SL = torch.where(dual_taken_SL, cap_SL, loss_SL)
    return loss_SL, clip_taken_SL, dual_taken_SL


def grpo_loss(
    logprobs_SL: torch.Tensor,
    old_logprobs_SL: torch.Tensor,
    advantages: torch.Tensor,
    response_mask_SL: torch.Tensor,
    config: GRPOConfig,
    ref_logprobs_SL: torch.Tensor | None = None,
    denominator: float | None = None,
    sequence_num_tokens_S: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """The GRPO step loss (differentiable in `logprobs_SL`) and its logging stats.

    `advantages` is per sample (S,) or per token (S, L). `ref_logprobs_SL` is required when
    `config.init_kl_coef > 0`. `denominator` / `sequence_num_tokens_S`: see the module docstring.
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(response_mask_SL)
    _check_shapes(response_mask_SL, logprobs=logprobs_SL, old_logprobs=old_logprobs_SL,
                  advantages=advantages, ref_logprobs=ref_logprobs_SL)
    if config.init_kl_coef > 0 and ref_logprobs_SL is None:
        raise ValueError(f"ref_logprobs: required when flexrl.rl.init_kl_coef > 0 (it is {config.init_kl_coef})")
    mask_SL = response_mask_SL.bool()
    # Zero the masked positions first: no inf/NaN from padding can reach a value or a gradient.
    logprobs_SL, old_logprobs_SL, advantages = (
        torch.where(mask_SL, tensor, torch.zeros_like(tensor))
        for tensor in (logprobs_SL, old_logprobs_SL.detach(), advantages.detach())
    )
    log_ratio_SL = logprobs_SL - old_logprobs_SL
    ratio_SL = log_ratio_SL.clamp(max=MAX_LOG_RATIO).exp()
    pg_SL, clip_taken_SL, dual_taken_SL = clipped_surrogate(ratio_SL, advantages, config)
    reduce_args = dict(mask_SL=mask_SL, reduction=config.loss_reduction, denominator=denominator,
                       sequence_num_tokens_S=sequence_num_tokens_S)
    policy_loss = reduce_masked(pg_SL, **reduce_args)
    kl_loss = torch.zeros((), dtype=policy_loss.dtype, device=policy_loss.device)
    if ref_logprobs_SL is not None and config.init_kl_coef > 0:
        ref_SL = torch.where(mask_SL, ref_logprobs_SL.detach(), torch.zeros_like(logprobs_SL))
        kl_SL = approx_kl(logprobs_SL, ref_SL, config.kl_estimator, config.kl_clamp)
        kl_loss = reduce_masked(kl_SL, **reduce_args)
    loss = policy_loss + config.init_kl_coef * kl_loss
    stats = _stats(policy_loss, kl_loss, log_ratio_SL, clip_taken_SL, dual_taken_SL, mask_SL)
    return loss, stats


def _stats(policy_loss, kl_loss, log_ratio_SL, clip_taken_SL, dual_taken_SL, mask_SL) -> PolicyLossStats:
    with torch.no_grad():
        num_tokens = int(mask_SL.sum())

        def token_mean(values_SL: torch.Tensor) -> float:
            if num_tokens == 0:
                return 0.0
            return float(torch.where(mask_SL, values_SL.to(log_ratio_SL.dtype), 0.0).sum() / num_tokens)

        return PolicyLossStats(
            policy_loss=policy_loss.item(),
            kl_loss=kl_loss.item(),
            clip_fraction=token_mean(clip_taken_SL),
            dual_clip_fraction=token_mean(dual_taken_SL),
            approx_kl=token_mean(torch.expm1(log_ratio_SL.clamp(max=MAX_LOG_RATIO)) - log_ratio_SL),
            mean_ratio=token_mean(log_ratio_SL.clamp(max=MAX_LOG_RATIO).exp()),
            num_tokens=num_tokens,
        )
