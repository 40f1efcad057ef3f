"""Rollout-mismatch correction: truncated importance sampling (TIS) weights (pure torch).

The rollout engine samples from pi_rollout (vLLM's kernels, bf16), the trainer's old-policy pass
scores the same tokens as pi_old; the two differ a little (`rollout_logprob_diff`). The policy
gradient is an expectation under pi_old, so each token's loss is weighted by pi_old / pi_rollout,
truncated at `cap` to bound the variance (Yao et al., "Your efficient RL framework secretly brings
you off-policy RL training"; veRL's TIS, OpenRLHF's `is_correction_*` with mode "clip"):

- "token": w_t = min(exp(old_t - rollout_t), cap), per token;
- "sequence": one weight per sequence, w = min(exp(sum_t (old_t - rollout_t)), cap), the product of
  its tokens' ratios (veRL's sequence-level TIS), on every token of the sequence.

The weights are detached constants: the driver computes them from the two log-prob sets before the
update and the ranks multiply them into the policy-gradient term (rl/losses.grpo_loss). Statistics,
over the level's units (tokens, or sequences): the applied weights' mean, the largest weight before
truncation, and the share of units truncated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from flexrl_ds.rl.config import TIS_LEVELS

MAX_LOG_WEIGHT = 20.0
"""A log-weight is bounded here before exp (a sequence's sum of log-ratios can be large): exp(20) is
still far above any cap."""


@dataclass
class TISStats:
    """What a step's TIS weights were (over tokens at token level, over sequences at sequence level)."""

    weight_mean: float
    """Mean of the applied (truncated) weights."""
    weight_max: float
    """Largest weight before truncation."""
    clipped_frac: float
    """Share of the units whose weight was truncated at the cap."""


def tis_weights(old_logprobs_SL: torch.Tensor, rollout_logprobs_SL: torch.Tensor, mask_SL: torch.Tensor,
                level: str, cap: float) -> tuple[torch.Tensor, TISStats]:
    """(S, L) weights (0 where the mask is 0) and their statistics; rows are whole sequences."""
    if level not in TIS_LEVELS or level == "off":
        raise ValueError(f"tis_level: {level!r} is not one of token, sequence")
    if not cap > 0:
        raise ValueError(f"tis_cap: must be positive, got {cap}")
    mask_SL = mask_SL.bool()
    log_SL = torch.where(mask_SL, old_logprobs_SL.double() - rollout_logprobs_SL.double(), 0.0)
    if level == "token":
        raw_U, unit_mask_U = log_SL.clamp(max=MAX_LOG_WEIGHT).exp(), mask_SL
    else:
        raw_U, unit_mask_U = log_SL.sum(dim=-1).clamp(max=MAX_LOG_WEIGHT).exp(), mask_SL.any(dim=-1)
    weights_U = raw_U.clamp(max=cap)
    units = max(int(unit_mask_U.sum()), 1)
    stats = TISStats(weight_mean=float(torch.where(unit_mask_U, weights_U, 0.0).sum()) / units,
                     weight_max=float(torch.where(unit_mask_U, raw_U, 0.0).max()) if unit_mask_U.any() else 0.0,
                     clipped_frac=float((unit_mask_U & (raw_U > cap)).sum()) / units)
    weights_SL = weights_U if level == "token" else weights_U[:, None].expand_as(log_SL)
    return torch.where(mask_SL, weights_SL, 0.0).to(old_logprobs_SL.dtype), stats


def padded(rows: Sequence[Sequence[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, Lmax) float64 rows right-padded with 0, and their mask."""
    longest = max((len(row) for row in rows), default=0)
    values = torch.zeros(len(rows), longest, dtype=torch.float64)
    mask = torch.zeros(len(rows), longest, dtype=torch.bool)
    for index, row in enumerate(rows):
        values[index, :len(row)] = torch.tensor(list(row), dtype=torch.float64)
        mask[index, :len(row)] = True
    return values, mask


def sample_tis_weights(old: Mapping[str, Sequence[float]], rollout: Mapping[str, Sequence[float]],
                       names: Sequence[str], level: str, cap: float) -> tuple[dict[str, list[float]], TISStats]:
    """`tis_weights` of samples given as per-token lists by name (the driver's form)."""
    for name in names:
        if len(old[name]) != len(rollout[name]):
            raise ValueError(f"sample {name}: {len(old[name])} old-policy log-probs for {len(rollout[name])} "
                             "rollout ones")
    old_SL, mask_SL = padded([old[name] for name in names])
    rollout_SL, _ = padded([rollout[name] for name in names])
    weights_SL, stats = tis_weights(old_SL, rollout_SL, mask_SL, level, cap)
    return {name: weights_SL[index, :len(old[name])].tolist() for index, name in enumerate(names)}, stats
