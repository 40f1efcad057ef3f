"""The GRPO loss on one rank's tokens: per-sample values spread onto local tokens, then rl/losses.

A rank of a FlexUlysses step holds slices of several sequences (`RankLayout.segments()`). The
driver sends, per sample, the old-policy and reference log-probs of its response tokens and its
advantage; `local_values` places them at the rank's local token positions (response token j of a
sample is predicted at position response_start - 1 + j). `rank_grpo_loss` runs the pure
`rl/losses.grpo_loss` over the rank's tokens as one row, with the mini-batch's GLOBAL denominator,
and multiplies by the world size: DeepSpeed averages gradients over ranks, so the averaged
gradient is that of the single-process mini-batch loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from flexrl_ds.rl.losses import grpo_loss


@dataclass
class LocalValues:
    """Per local token of one rank (shape (local,))."""

    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    response_mask: torch.Tensor


def local_values(batch: Any, samples: Mapping[str, Any], old: Mapping[str, list[float]],
                 ref: Mapping[str, list[float]], advantages: Mapping[str, float]) -> LocalValues:
    """Spread per-sample response values onto this rank's local tokens."""
    num_local = batch.layout.num_local_tokens
    old_t = torch.zeros(num_local, dtype=torch.float32)
    ref_t = torch.zeros(num_local, dtype=torch.float32) if ref else None
    adv_t = torch.zeros(num_local, dtype=torch.float32)
    for seq_id, lo, hi, local in batch.layout.segments():
        sample = samples[seq_id]
        first = sample.response_start - 1  # position whose target is the first response token
        for position in range(max(lo, first), min(hi, sample.length - 1)):
            index, j = local + position - lo, position - first
            old_t[index] = old[seq_id][j]
            if ref_t is not None:
                ref_t[index] = ref[seq_id][j]
            adv_t[index] = advantages[seq_id]
    return LocalValues(old_t, ref_t, adv_t, batch.response_mask.bool())


def rank_grpo_loss(engine: Any, batch: Any, values: LocalValues, config: Any, denominator: float,
                   world_size: int) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss to backward, summed statistics of this rank's tokens)."""
    logprobs, entropy, zero = engine(batch, with_entropy=config.entropy_coef > 0)
    device = logprobs.device
    mask = values.response_mask.to(device)[None]
    loss, stats = grpo_loss(
        logprobs[None], values.old_logprobs.to(device)[None], values.advantages.to(device)[None], mask, config,
        ref_logprobs_SL=None if values.ref_logprobs is None else values.ref_logprobs.to(device)[None],
        denominator=denominator)
    num_tokens = int(mask.sum())
    entropy_sum = 0.0
    if entropy is not None:
        masked_entropy = torch.where(mask[0], entropy, torch.zeros_like(entropy))
        loss = loss - config.entropy_coef * masked_entropy.sum() / denominator
        entropy_sum = float(masked_entropy.detach().sum())
    # pg_loss / kl / loss are already divided by the global denominator: their sums over ranks are
    # the mini-batch means. The fractions are means over this rank's tokens: back to sums.
    summed = {"loss": float(loss.detach()), "pg_loss": stats.policy_loss, "kl": stats.kl_loss,
              "clip_frac": stats.clip_fraction * num_tokens, "approx_kl": stats.approx_kl * num_tokens,
              "entropy": entropy_sum, "num_tokens": float(num_tokens)}
    return loss * world_size + zero, summed
