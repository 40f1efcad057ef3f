"""GRPO advantages: one scalar per sample from the rewards of its prompt's group (pure torch).

Samples are prompt-major: sample k of prompt p sits at flat index p * n + k (n = samples per
prompt), the order of the loader's `SampleId(step, slot, k)`. Estimators follow OpenRLHF's
`--advantage_estimator`:

- `group_norm` (GRPO): (r - mean_group) / (std_group + eps), std with Bessel's correction (n - 1),
  and a group whose rewards are all equal gets advantages exactly 0 (every estimator; OpenRLHF's
  plain formula gives ~0.9 there in float32, from rounding in the mean);
- `dr_grpo` (Dr. GRPO): r - mean_group, no std division (what OpenRLHF's group_norm gives with
  --no_advantage_std_norm; `no_std_norm` turns group_norm into this);
- `rloo`: r - mean of the group's other n - 1 rewards;
- `reinforce_baseline` (REINFORCE++-baseline): r - mean_group, then whitened over the step's samples
  ((a - mean) / (std + eps) over all of them; `no_std_norm`: centred only). OpenRLHF whitens over
  the batch's tokens, which weighs a sample by its response length; here each sample counts once.

`reward_clip` clamps rewards before the estimator and `advantage_clip` the advantages after it
(OpenRLHF clamps rewards at +-10 by default). With outcome rewards every response token of a sample
carries the sample's advantage (`token_advantages`); the reference-KL term lives in the loss
(rl/losses.py), or, with `kl_in_reward`, in per-token rewards (`kl_reward_advantages`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def grouped_rewards(rewards: torch.Tensor, num_samples_per_prompt: int) -> torch.Tensor:
    """`rewards` of shape (num_prompts * n,) or (num_prompts, n), checked, as a (num_prompts, n) view.

    Raises ValueError for a wrong shape or a non-finite reward, naming the flat sample index.
    """
    n = num_samples_per_prompt
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"num_samples_per_prompt: must be a positive integer, got {n!r}")
    if not torch.is_floating_point(rewards):
        raise ValueError(f"rewards: expected a floating-point tensor, got {rewards.dtype}")
    if rewards.dim() == 2:
        if rewards.shape[1] != n:
            raise ValueError(f"rewards: shape {tuple(rewards.shape)} is not (num_prompts, {n})")
    elif rewards.dim() != 1 or rewards.numel() % n != 0:
        raise ValueError(
            f"rewards: shape {tuple(rewards.shape)} is neither (num_prompts * {n},) nor (num_prompts, {n})"
        )
    if rewards.numel() == 0:
        raise ValueError("rewards: empty")
    bad = (~torch.isfinite(rewards.reshape(-1))).nonzero()
    if bad.numel():
        index = int(bad[0, 0])
        raise ValueError(
            f"rewards: sample {index} (prompt {index // n}, k={index % n}) has non-finite reward "
            f"{rewards.reshape(-1)[index].item()}; {bad.numel()} sample(s) in all"
        )
    return rewards.reshape(-1, n)


def _group_norm(groups_PN: torch.Tensor, eps: float, std_norm: bool = True) -> torch.Tensor:
    centred_PN = groups_PN - groups_PN.mean(dim=1, keepdim=True)
    return centred_PN / (groups_PN.std(dim=1, keepdim=True) + eps) if std_norm else centred_PN


def _dr_grpo(groups_PN: torch.Tensor, eps: float, std_norm: bool = True) -> torch.Tensor:
    return groups_PN - groups_PN.mean(dim=1, keepdim=True)


def _rloo(groups_PN: torch.Tensor, eps: float, std_norm: bool = True) -> torch.Tensor:
    others_mean_PN = (groups_PN.sum(dim=1, keepdim=True) - groups_PN) / (groups_PN.shape[1] - 1)
    return groups_PN - others_mean_PN


@dataclass(frozen=True)
class AdvantageEstimator:
    """One entry of `ESTIMATORS`."""

    compute: Callable[[torch.Tensor, float, bool], torch.Tensor]
    """(rewards (num_prompts, n), eps, std_norm) -> advantages (num_prompts, n)."""
    min_samples_per_prompt: int
    """Smallest group size n it is defined for."""
    batch_whitened: bool = False
    """Whiten the result over all the step's samples (after equal-reward groups are pinned to 0)."""


ESTIMATORS: dict[str, AdvantageEstimator] = {
    "group_norm": AdvantageEstimator(_group_norm, min_samples_per_prompt=2),  # a group of one has no spread
    "dr_grpo": AdvantageEstimator(_dr_grpo, min_samples_per_prompt=1),
    "rloo": AdvantageEstimator(_rloo, min_samples_per_prompt=2),  # ... and no "others"
    "reinforce_baseline": AdvantageEstimator(_dr_grpo, min_samples_per_prompt=1, batch_whitened=True),
}
"""The advantage estimators by name (`flexrl.rl.advantage_estimator`). A new estimator is one
function and one entry here; `rl/config.py` lists the names without importing torch
(`ADVANTAGE_ESTIMATORS`, kept equal to these keys by a test)."""


def group_advantages(
    rewards: torch.Tensor,
    num_samples_per_prompt: int,
    estimator: str = "group_norm",
    eps: float = 1e-9,
    std_norm: bool = True,
    reward_clip: float | None = None,
    advantage_clip: float | None = None,
) -> torch.Tensor:
    """Per-sample advantages, in the shape `rewards` came in (see the module docstring).

    group_norm and rloo need n >= 2 (a group of one has no spread and no "others"). `std_norm`
    False: no division by a std (flexrl.rl.no_std_norm).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator: {estimator!r} is not one of {', '.join(ESTIMATORS)}")
    groups_PN = grouped_rewards(rewards, num_samples_per_prompt)
    if reward_clip is not None:
        groups_PN = groups_PN.clamp(-reward_clip, reward_clip)
    n, entry = num_samples_per_prompt, ESTIMATORS[estimator]
    if n < entry.min_samples_per_prompt:
        raise ValueError(f"estimator {estimator!r} needs num_samples_per_prompt >= {entry.min_samples_per_prompt}, "
                         f"got {n}")
    advantages_PN = entry.compute(groups_PN, eps, std_norm)
    # A group of equal rewards carries no signal. Rounding leaves r - mean ~ ulp and std ~ ulp, which
    # group_norm would blow up to O(1) in float32 (0.1 x 7 gives 0.82): pin such groups to 0.
    constant_P1 = groups_PN.amax(dim=1, keepdim=True) == groups_PN.amin(dim=1, keepdim=True)
    advantages_PN = advantages_PN.masked_fill(constant_P1, 0.0)
    if entry.batch_whitened and advantages_PN.numel() > 1:
        centred_PN = advantages_PN - advantages_PN.mean()
        advantages_PN = centred_PN / (advantages_PN.std() + eps) if std_norm else centred_PN
        advantages_PN = advantages_PN.masked_fill(constant_P1, 0.0)
    if advantage_clip is not None:
        advantages_PN = advantages_PN.clamp(-advantage_clip, advantage_clip)
    return advantages_PN.reshape(rewards.shape)


def token_advantages(advantages_S: torch.Tensor, response_mask_SL: torch.Tensor) -> torch.Tensor:
    """Broadcast per-sample advantages (S,) onto response tokens (S, L); 0 where the mask is 0."""
    if advantages_S.dim() != 1:
        raise ValueError(f"advantages: expected shape (num_samples,), got {tuple(advantages_S.shape)}")
    if response_mask_SL.dim() != 2 or response_mask_SL.shape[0] != advantages_S.shape[0]:
        raise ValueError(
            f"response_mask: shape {tuple(response_mask_SL.shape)} is not ({advantages_S.shape[0]}, L)"
        )
    return advantages_S[:, None] * response_mask_SL.to(advantages_S.dtype)


def kl_reward_advantages(advantage: float, kl_tokens: list[float], kl_coef: float) -> list[float]:
    """Per-token advantages of one sample under `kl_in_reward`: token t's reward is -kl_coef * kl_t (the
    sample's own reward sits at its last token, turned into `advantage` by the group estimator), and
    its advantage the sum of the rewards from t to the end (gamma 1, OpenRLHF's cumulative returns)."""
    out, running = [0.0] * len(kl_tokens), 0.0
    for t in range(len(kl_tokens) - 1, -1, -1):
        running += -kl_coef * kl_tokens[t]
        out[t] = advantage + running
    return out
