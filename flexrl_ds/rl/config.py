"""GRPO knobs (section `flexrl.rl` of a run config), named after OpenRLHF's CLI flags.

Torch-free so that loading a config never imports torch. The GRPO group size n is not here: it is
`flexrl.data.loader.num_samples_per_prompt` (the loader composes the groups), and the advantage
functions take it as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ADVANTAGE_ESTIMATORS = ("group_norm", "dr_grpo", "rloo")
"""Group baselines: (r - mean) / (std + eps) | r - mean | r - mean of the other n - 1 samples."""
KL_ESTIMATORS = ("k1", "k2", "k3")
"""Per-token estimators of KL(policy || reference) from sampled-token log-probs (Schulman's k1/k2/k3)."""
LOSS_REDUCTIONS = ("token_mean", "sequence_mean")
"""token_mean: sum over every response token of the mini-batch / token count; sequence_mean: mean per
sequence, then sum / sequence count (each of the step's `mini_batches_per_step` mini-batches is one
optimizer step with its own loss; the LR scheduler steps once per mini-batch)."""


@dataclass
class GRPOConfig:
    """GRPO advantage and loss settings (section `flexrl.rl`)."""

    advantage_estimator: Literal["group_norm", "dr_grpo", "rloo"] = "group_norm"
    """How a sample's reward becomes its advantage within its prompt's group (ADVANTAGE_ESTIMATORS)."""
    advantage_eps: float = 1e-9
    """group_norm: added to the group's std, so a group of equal rewards gets advantages 0."""
    eps_clip_low: float = 0.2
    """PPO clip: the ratio is clipped below at 1 - eps_clip_low; in [0, 1)."""
    eps_clip_high: float = 0.2
    """PPO clip: the ratio is clipped above at 1 + eps_clip_high (DAPO's clip-higher: > eps_clip_low)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1: for negative advantages the loss is capped at -c * A; None: off."""
    init_kl_coef: float = 0.01
    """Weight of the KL(policy || reference) term in the loss; 0: no reference log-probs needed."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (KL_ESTIMATORS). k3 (the usual GRPO choice) and k2 pull the policy towards
    the reference; k1's gradient, that of log pi, averages to zero over on-policy samples, so as a loss
    term it adds noise and no pull (its value is still an unbiased estimate of the KL)."""
    kl_clamp: float | None = 10.0
    """Per-token KL values are clamped to [-kl_clamp, kl_clamp] (as OpenRLHF does); None: no clamp."""
    loss_reduction: Literal["token_mean", "sequence_mean"] = "token_mean"
    """How per-token losses become the step loss (LOSS_REDUCTIONS)."""
    reward_fn: str = "accuracy"
    """The reward: a built-in name (flexrl_ds/rl/rewards.py, REWARDS) or "path/to/file.py:function", a
    function (responses: list[str], records: list[dict]) -> list[float], one float per response.
    `flexrl train` takes a relative path against the run config file's folder (rl/reward_fn.py)."""
    reward_timeout_s: float | None = 300.0
    """The longest wait, in seconds, for one call of the reward function; a call given up on scores
    its samples 0, reported, as a raising one does (rl/reward_fn.py: a batch call is retried per
    sample; a function that hangs on every input stops the run within three limits). None: no limit."""
    mini_batches_per_step: int = 1
    """Optimizer steps per GRPO step; the step's samples are split into this many mini-batches, each
    planned with FlexUlysses."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (loss -= entropy_coef * mean token entropy); 0: off."""

    def __post_init__(self) -> None:
        for name, allowed in (("advantage_estimator", ADVANTAGE_ESTIMATORS), ("kl_estimator", KL_ESTIMATORS),
                              ("loss_reduction", LOSS_REDUCTIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"flexrl.rl.{name}: {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if not self.advantage_eps > 0:
            raise ValueError(f"flexrl.rl.advantage_eps: must be positive, got {self.advantage_eps}")
        if not 0 <= self.eps_clip_low < 1:
            raise ValueError(f"flexrl.rl.eps_clip_low: must be in [0, 1), got {self.eps_clip_low}")
        if not self.eps_clip_high >= 0:
            raise ValueError(f"flexrl.rl.eps_clip_high: must be >= 0, got {self.eps_clip_high}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"flexrl.rl.dual_clip: must be > 1 (or null), got {self.dual_clip}")
        if not self.init_kl_coef >= 0:
            raise ValueError(f"flexrl.rl.init_kl_coef: must be >= 0, got {self.init_kl_coef}")
        if self.mini_batches_per_step < 1:
            raise ValueError(f"flexrl.rl.mini_batches_per_step: must be at least 1, got {self.mini_batches_per_step}")
        if not self.entropy_coef >= 0:
            raise ValueError(f"flexrl.rl.entropy_coef: must be >= 0, got {self.entropy_coef}")
        if self.reward_timeout_s is not None and not self.reward_timeout_s > 0:
            raise ValueError(f"flexrl.rl.reward_timeout_s: must be positive (or null), got {self.reward_timeout_s}")
        if self.kl_clamp is not None and not self.kl_clamp > 0:
            raise ValueError(f"flexrl.rl.kl_clamp: must be positive (or null), got {self.kl_clamp}")
