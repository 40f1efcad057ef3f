"""GRPO policy loss: PPO-clip (or GSPO) surrogate plus a KL penalty to the reference (pure torch).

Inputs are per-token tensors of shape (S, L): S sequences (samples) of L response positions, with
`response_mask_SL` marking real response tokens. Masked positions never reach the result, even if
they hold inf/NaN (padding log-probs), because they are selected away, not multiplied by 0.

Per token t, with advantage A and ratio = exp(logprob - old_logprob) (`policy_loss` "ppo_clip"), or
for "gspo" one ratio per sequence, exp(mean over the sequence's tokens of logprob - old_logprob):
    pg = -min(ratio * A, clip(ratio, 1 - eps_clip_low, 1 + eps_clip_high) * A)
    dual clip (c > 1, only where A < 0): pg = min(pg, -c * A)
    TIS (tis_level not "off"): pg = w * pg, w the detached weight of rl/correction.py
    loss_t = pg + kl_coef * kl_estimator(logprob, ref_logprob)   (no KL term under kl_in_reward)
and the step loss reduces pg with `reduce_masked`:
- `token_mean`: sum over every response token / denominator (default: this call's token count);
- `sequence_mean`: each sequence's token sum / its token count, summed / denominator (default:
  the number of sequences with at least one token; an all-masked sequence adds nothing);
- `seq_mean_token_sum`: every token's value summed / denominator (default: the sequence count);
- `seq_mean_token_sum_norm`: the same / norm_length (default denominator: sequence count x norm_length).
The KL term is reduced the same way, or by token_mean (`kl_entropy_reduction` "token_mean").

Distributed use: no collectives here. Under ZeRO-3 + FlexUlysses each rank holds a slice of the
step's tokens; pass `denominator` = the GLOBAL token (or sequence) count, and for `sequence_mean`
`sequence_num_tokens_S` = each local sequence's FULL token count (a sequence may be split over an
SP group), then scale by the world size before `engine.backward` as `models/zero3.flex_step_loss`
does, so DeepSpeed's gradient averaging yields the single-process gradient.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from flexrl_ds.rl.config import KL_ESTIMATORS, LOSS_REDUCTIONS, GRPOConfig

TOKEN_SUM_REDUCTIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
"""Reductions whose numerator is the plain sum over tokens (only the denominator differs)."""

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
    norm_length: int | None = None,
) -> torch.Tensor:
    """Masked reduction of per-token values to a scalar (see the module docstring). `norm_length`:
    seq_mean_token_sum_norm's constant, needed without an explicit `denominator`."""
    if reduction not in LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction: {reduction!r} is not one of {', '.join(LOSS_REDUCTIONS)}")
    if mask_SL.shape != values_SL.shape:
        raise ValueError(f"response_mask: shape {tuple(mask_SL.shape)} differs from {tuple(values_SL.shape)}")
    mask_SL = mask_SL.bool()
    sums_S = torch.where(mask_SL, values_SL, torch.zeros_like(values_SL)).sum(dim=-1)
    if reduction in TOKEN_SUM_REDUCTIONS:
        numerator = sums_S.sum()
        if reduction == "seq_mean_token_sum_norm" and denominator is None and norm_length is None:
            raise ValueError("seq_mean_token_sum_norm: pass norm_length (or an explicit denominator)")
    else:
        counts_S = mask_SL.sum(dim=-1) if sequence_num_tokens_S is None else sequence_num_tokens_S
        if counts_S.shape != sums_S.shape:
            raise ValueError(f"sequence_num_tokens: shape {tuple(counts_S.shape)} is not {tuple(sums_S.shape)}")
        numerator = (sums_S / counts_S.clamp_min(1).to(sums_S.dtype)).sum()
    if denominator is None:  # counted from the mask only here: reading a count waits for the device
        local_count = int(mask_SL.sum()) if reduction == "token_mean" else int((mask_SL.sum(dim=-1) > 0).sum())
        if reduction == "seq_mean_token_sum_norm":
            local_count *= norm_length  # type: ignore[operator]
        if local_count == 0:
            raise ValueError("response_mask: no response tokens; pass an explicit denominator")
        denominator = local_count
    if not denominator > 0:
        raise ValueError(f"denominator: must be positive, got {denominator}")
    return numerator / denominator


STAT_SUMS = ("policy_loss", "kl_loss", "clip_count", "dual_clip_count", "approx_kl_sum", "ratio_sum", "num_tokens")
"""The entries of `PolicyLossStats.sums`, in order."""


@dataclass
class PolicyLossStats:
    """Detached logging numbers of one `grpo_loss` call (means over its own response tokens), kept on
    the loss's device as one tensor: reading a property waits for the device once (all are read
    together); a caller adding calls up takes `sums` without waiting."""

    sums: torch.Tensor
    """(len(STAT_SUMS),) float64, detached: the policy and KL losses (reduced like the loss) and the
    sums over response tokens of the clip and dual-clip indicators, the k3 KL estimate, the ratio,
    and 1 (the token count)."""

    @functools.cached_property
    def _values(self) -> dict[str, float]:
        return dict(zip(STAT_SUMS, self.sums.tolist()))

    def _token_mean(self, name: str) -> float:
        count = self._values["num_tokens"]
        return self._values[name] / count if count > 0 else 0.0

    @property
    def policy_loss(self) -> float:
        """The clipped surrogate part of the loss, reduced like the loss."""
        return self._values["policy_loss"]

    @property
    def kl_loss(self) -> float:
        """The reference-KL part before weighting by init_kl_coef, reduced like the loss (0 if unused)."""
        return self._values["kl_loss"]

    @property
    def clip_fraction(self) -> float:
        """Fraction of tokens whose clipped branch was taken (the ratio left the clip range the wrong way)."""
        return self._token_mean("clip_count")

    @property
    def dual_clip_fraction(self) -> float:
        """Fraction of tokens capped by the dual clip (0 when it is off)."""
        return self._token_mean("dual_clip_count")

    @property
    def approx_kl(self) -> float:
        """Mean k3 estimate of KL(old policy || policy): how far this update has moved."""
        return self._token_mean("approx_kl_sum")

    @property
    def mean_ratio(self) -> float:
        """Mean of exp(logprob - old_logprob)."""
        return self._token_mean("ratio_sum")

    @property
    def num_tokens(self) -> int:
        """Response tokens these means are over (weight them by this to combine ranks)."""
        return int(self._values["num_tokens"])


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


def sequence_log_ratio_sums(logprobs_SL: torch.Tensor, old_logprobs_SL: torch.Tensor,
                            response_mask_SL: torch.Tensor) -> torch.Tensor:
    """(S,) each row's sum over its response tokens of logprob - old_logprob (differentiable in
    `logprobs_SL`): GSPO's numerator. A caller whose rows are pieces of longer sequences adds up the
    pieces' sums of each sequence (across ranks) and passes the mean as `sequence_log_ratio_S`."""
    mask_SL = response_mask_SL.bool()
    log_ratio_SL = torch.where(mask_SL, logprobs_SL - old_logprobs_SL.detach(), torch.zeros_like(logprobs_SL))
    return log_ratio_SL.sum(dim=-1)


def _ratio(log_ratio_SL: torch.Tensor, mask_SL: torch.Tensor, config: GRPOConfig,
           sequence_num_tokens_S: torch.Tensor | None, sequence_log_ratio_S: torch.Tensor | None) -> torch.Tensor:
    """The importance ratio at each token: its own (ppo_clip) or its sequence's (gspo)."""
    if config.policy_loss == "ppo_clip":
        return log_ratio_SL.clamp(max=MAX_LOG_RATIO).exp()
    if sequence_log_ratio_S is None:
        counts_S = mask_SL.sum(dim=-1) if sequence_num_tokens_S is None else sequence_num_tokens_S
        sequence_log_ratio_S = log_ratio_SL.sum(dim=-1) / counts_S.clamp_min(1).to(log_ratio_SL.dtype)
    return sequence_log_ratio_S.clamp(max=MAX_LOG_RATIO).exp()[:, None].expand_as(log_ratio_SL)


def grpo_loss(
    logprobs_SL: torch.Tensor,
    old_logprobs_SL: torch.Tensor,
    advantages: torch.Tensor,
    response_mask_SL: torch.Tensor,
    config: GRPOConfig,
    ref_logprobs_SL: torch.Tensor | None = None,
    denominator: float | None = None,
    sequence_num_tokens_S: torch.Tensor | None = None,
    *,
    is_weights_SL: torch.Tensor | None = None,
    kl_coef: float | None = None,
    kl_denominator: float | None = None,
    norm_length: int | None = None,
    sequence_log_ratio_S: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PolicyLossStats]:
    """The GRPO step loss (differentiable in `logprobs_SL`) and its logging stats.

    `advantages` is per sample (S,) or per token (S, L). `ref_logprobs_SL` is required when the loss
    has a KL term (kl_coef, default `config.init_kl_coef`, > 0 and not `config.kl_in_reward`).
    `denominator` / `sequence_num_tokens_S` / `norm_length`: see the module docstring and
    `reduce_masked`; `kl_denominator`: the KL term's under kl_entropy_reduction "token_mean" (default:
    this call's token count). `is_weights_SL`: the TIS weights (rl/correction.py). `sequence_log_ratio_S`:
    gspo's per-row mean log-ratio of the row's whole sequence (default: from the row itself).
    """
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(response_mask_SL)
    _check_shapes(response_mask_SL, logprobs=logprobs_SL, old_logprobs=old_logprobs_SL,
                  advantages=advantages, ref_logprobs=ref_logprobs_SL, is_weights=is_weights_SL)
    kl_coef = config.init_kl_coef if kl_coef is None else kl_coef
    with_kl = kl_coef > 0 and not config.kl_in_reward
    if with_kl and ref_logprobs_SL is None:
        raise ValueError(f"ref_logprobs: required when flexrl.rl.init_kl_coef > 0 (it is {kl_coef})")
    mask_SL = response_mask_SL.bool()
    # Zero the masked positions first: no inf/NaN from padding can reach a value or a gradient.
    logprobs_SL, old_logprobs_SL, advantages = (
        torch.where(mask_SL, tensor, torch.zeros_like(tensor))
        for tensor in (logprobs_SL, old_logprobs_SL.detach(), advantages.detach())
    )
    log_ratio_SL = logprobs_SL - old_logprobs_SL
    ratio_SL = _ratio(log_ratio_SL, mask_SL, config, sequence_num_tokens_S, sequence_log_ratio_S)
    pg_SL, clip_taken_SL, dual_taken_SL = clipped_surrogate(ratio_SL, advantages, config)
    if is_weights_SL is not None:
        pg_SL = pg_SL * torch.where(mask_SL, is_weights_SL.detach(), torch.zeros_like(pg_SL))
    reduce_args = dict(mask_SL=mask_SL, reduction=config.loss_reduction, denominator=denominator,
                       sequence_num_tokens_S=sequence_num_tokens_S, norm_length=norm_length)
    policy_loss = reduce_masked(pg_SL, **reduce_args)
    kl_loss = torch.zeros((), dtype=policy_loss.dtype, device=policy_loss.device)
    if with_kl:
        ref_SL = torch.where(mask_SL, ref_logprobs_SL.detach(), torch.zeros_like(logprobs_SL))
        kl_SL = approx_kl(logprobs_SL, ref_SL, config.kl_estimator, config.kl_clamp)
        if config.kl_entropy_reduction == "token_mean":
            reduce_args = dict(mask_SL=mask_SL, reduction="token_mean", denominator=kl_denominator)
        kl_loss = reduce_masked(kl_SL, **reduce_args)
    loss = policy_loss + kl_coef * kl_loss
    stats = _stats(policy_loss, kl_loss, log_ratio_SL, clip_taken_SL, dual_taken_SL, mask_SL)
    return loss, stats


def _stats(policy_loss, kl_loss, log_ratio_SL, clip_taken_SL, dual_taken_SL, mask_SL) -> PolicyLossStats:
    """The stats as device tensors (`STAT_SUMS`): no host sync here."""
    with torch.no_grad():

        def token_sum(values_SL: torch.Tensor) -> torch.Tensor:
            return torch.where(mask_SL, values_SL.to(log_ratio_SL.dtype), 0.0).sum().double()

        clamped_SL = log_ratio_SL.clamp(max=MAX_LOG_RATIO)
        return PolicyLossStats(torch.stack([
            policy_loss.detach().double(), kl_loss.detach().double(), token_sum(clip_taken_SL),
            token_sum(dual_taken_SL), token_sum(torch.expm1(clamped_SL) - log_ratio_SL), token_sum(clamped_SL.exp()),
            mask_SL.sum().double()]))
