"""GRPO knobs (section `flexrl.rl` of a run config), named after OpenRLHF's CLI flags.

Torch-free so that loading a config never imports torch. The GRPO group size n is not here: it is
`flexrl.data.loader.num_samples_per_prompt` (the loader composes the groups), and the advantage
functions take it as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ADVANTAGE_ESTIMATORS = ("group_norm", "dr_grpo", "rloo", "reinforce_baseline")
"""Group baselines: (r - mean) / (std + eps) | r - mean | r - mean of the other n - 1 samples |
r - mean, then whitened over the step's samples (rl/advantages.py)."""
POLICY_LOSSES = ("ppo_clip", "gspo")
"""ppo_clip: per-token ratio, PPO clip; gspo: one ratio per sequence, exp(mean over its tokens of the
log-ratio), PPO-clipped (GSPO, arXiv 2507.18071; rl/losses.py)."""
TIS_LEVELS = ("off", "token", "sequence")
"""Truncated importance sampling of the rollout-trainer mismatch (rl/correction.py)."""
KL_ESTIMATORS = ("k1", "k2", "k3")
"""Per-token estimators of KL(policy || reference) from sampled-token log-probs (Schulman's k1/k2/k3)."""
LOSS_REDUCTIONS = ("token_mean", "sequence_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
"""token_mean: sum over every response token of the mini-batch / token count; sequence_mean: mean per
sequence, then sum / sequence count; seq_mean_token_sum: sum per sequence, then / sequence count
(veRL's seq-mean-token-sum); seq_mean_token_sum_norm: sum per sequence / loss_norm_length, then /
sequence count (Dr. GRPO's constant normaliser; veRL's seq-mean-token-sum-norm up to its batch
factor). Each of the step's `mini_batches_per_step` x `ppo_epochs` mini-batches is one optimizer
step with its own loss; the LR scheduler steps once per mini-batch."""
KL_ENTROPY_REDUCTIONS = ("loss", "token_mean")


@dataclass
class GRPOConfig:
    """GRPO advantage and loss settings (section `flexrl.rl`)."""

    advantage_estimator: Literal["group_norm", "dr_grpo", "rloo", "reinforce_baseline"] = "group_norm"
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
    """Weight of the KL(policy || reference) term in the loss (or in the reward: kl_in_reward); 0: no
    reference log-probs needed. The adaptive controller (kl_target) starts from it."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token KL estimator (KL_ESTIMATORS). k3 (the usual GRPO choice) and k2 pull the policy towards
    the reference; k1's gradient, that of log pi, averages to zero over on-policy samples, so as a loss
    term it adds noise and no pull (its value is still an unbiased estimate of the KL)."""
    kl_clamp: float | None = 10.0
    """Per-token KL values are clamped to [-kl_clamp, kl_clamp] (as OpenRLHF does); None: no clamp."""
    loss_reduction: Literal["token_mean", "sequence_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"] = \
        "token_mean"
    """How per-token losses become the step loss (LOSS_REDUCTIONS). token_mean is also DAPO's choice
    (its "token-level policy gradient loss"): keep it for a DAPO recipe."""
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
    router_aux_loss_coef: float = 0.0
    """Weight of a sparse MoE decoder's router auxiliary (load-balancing) loss in the loss; 0: only
    reported (metric `router_aux_loss`, MoE models only)."""

    policy_loss: Literal["ppo_clip", "gspo"] = "ppo_clip"
    """The surrogate (POLICY_LOSSES). gspo takes loss_reduction "sequence_mean" (each sequence one
    term, as in the paper and OpenRLHF) and much smaller clip ranges than PPO (the paper: 3e-4, 4e-4)."""
    tis_level: Literal["off", "token", "sequence"] = "off"
    """Rollout-mismatch correction (TIS_LEVELS): each token's policy loss is weighted by
    min(pi_old / pi_rollout, tis_cap), per token ("token") or one weight per sequence, the product
    of its tokens' ratios ("sequence", veRL's sequence TIS); "off": no weight."""
    tis_cap: float = 2.0
    """The truncation of the TIS weights (veRL's tis_imp_ratio_cap; OpenRLHF's is_correction_threshold high)."""
    kl_in_reward: bool = False
    """Put the reference KL into the reward instead of the loss (OpenRLHF without --use_kl_loss): each
    token t gets -kl_coef * k1_t (k1 = old log-prob - reference log-prob), and a token's advantage
    is the sample's advantage plus the sum of those from t to the end (gamma = 1); the loss has no KL term."""
    kl_target: float | None = None
    """Adaptive KL controller (Ziegler et al.; OpenRLHF's --kl_target): after each step the KL
    coefficient is multiplied by 1 + clip(kl / kl_target - 1, -0.2, 0.2) * samples / kl_horizon, kl
    being the step's mean k1 per token; None: the coefficient stays init_kl_coef."""
    kl_horizon: int = 10000
    """The adaptive controller's horizon, in samples."""
    no_std_norm: bool = False
    """group_norm and reinforce_baseline: do not divide by the std (group_norm becomes dr_grpo's r - mean)."""
    reward_clip: float | None = None
    """Rewards are clamped to [-reward_clip, reward_clip] before the advantages (OpenRLHF: 10); None: off."""
    advantage_clip: float | None = None
    """Advantages are clamped to [-advantage_clip, advantage_clip]; None: off."""
    kl_entropy_reduction: Literal["loss", "token_mean"] = "loss"
    """How the KL and entropy terms are reduced: "loss" as the policy loss (loss_reduction), or
    "token_mean" whatever loss_reduction is (OpenRLHF's way under per-sequence losses). Default "loss":
    under sequence_mean every term then weighs each sequence alike, as before this key existed."""
    loss_norm_length: int | None = None
    """seq_mean_token_sum_norm's constant; None: flexrl.rollout.max_response_length (set by `flexrl train`)."""
    ppo_epochs: int = 1
    """Passes over the step's samples; each pass runs the step's mini-batches."""
    shuffle_mini_batches: bool = False
    """Deal the step's prompts (whole groups) into mini-batches in a random order drawn from (seed,
    step, epoch), so a resumed run draws the same order; False: prompt order, the same every epoch."""
    old_logprob_pass: Literal["auto", "always"] = "auto"
    """"auto": skip the old policy's log-prob pass where the old policy is the current one (one
    mini-batch, one epoch, and neither TIS, kl_in_reward nor kl_target needing its log-probs before
    the update): the update's own forward gives them (ratio 1 by construction), and the metrics say
    `old_logprob_pass` "skipped". "always": run it every step."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: groups whose rewards are all equal are dropped, and more of the step's
    prompts are rolled out until dynamic_sampling_prompts groups are kept or the rounds run out
    (trainer/dynamic_sampling.py). The loader's global_batch is the pool a step draws from."""
    dynamic_sampling_prompts: int | None = None
    """Groups a step trains on under dynamic sampling (the rest of global_batch is the reserve rolled
    out in later rounds); None: half of flexrl.data.loader.global_batch."""
    dynamic_sampling_max_rounds: int = 3
    """Rollout rounds a step may take (the first included) before it trains on the groups it has."""
    overlong_buffer_length: int = 0
    """DAPO's overlong penalty: a response of length l more than max_response_length - this gets reward
    += -overlong_penalty_factor * (l - (max_response_length - this)) / this; 0: off."""
    overlong_penalty_factor: float = 1.0
    """The penalty at max_response_length (rl/rewards.overlong_penalty)."""

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
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(f"flexrl.rl.router_aux_loss_coef: must be >= 0, got {self.router_aux_loss_coef}")
        if not self.entropy_coef >= 0:
            raise ValueError(f"flexrl.rl.entropy_coef: must be >= 0, got {self.entropy_coef}")
        if self.reward_timeout_s is not None and not self.reward_timeout_s > 0:
            raise ValueError(f"flexrl.rl.reward_timeout_s: must be positive (or null), got {self.reward_timeout_s}")
        if self.kl_clamp is not None and not self.kl_clamp > 0:
            raise ValueError(f"flexrl.rl.kl_clamp: must be positive (or null), got {self.kl_clamp}")
        choices = (("policy_loss", POLICY_LOSSES), ("tis_level", TIS_LEVELS),
                   ("old_logprob_pass", ("auto", "always")), ("kl_entropy_reduction", KL_ENTROPY_REDUCTIONS))
        for name, options in choices:
            if getattr(self, name) not in options:
                raise ValueError(f"flexrl.rl.{name}: {getattr(self, name)!r} is not one of {', '.join(options)}")
        if self.policy_loss == "gspo" and self.loss_reduction != "sequence_mean":
            raise ValueError(f"flexrl.rl.policy_loss: gspo weighs each sequence once: set flexrl.rl.loss_reduction "
                             f"to sequence_mean (it is {self.loss_reduction})")
        positive = {"tis_cap": self.tis_cap, "kl_target": self.kl_target, "reward_clip": self.reward_clip,
                    "advantage_clip": self.advantage_clip, "overlong_penalty_factor": self.overlong_penalty_factor}
        for name, value in positive.items():
            if value is not None and not value > 0:
                raise ValueError(f"flexrl.rl.{name}: must be positive{'' if name == 'tis_cap' else ' (or null)'}, "
                                 f"got {value}")
        at_least_one = {"kl_horizon": self.kl_horizon, "ppo_epochs": self.ppo_epochs,
                        "dynamic_sampling_max_rounds": self.dynamic_sampling_max_rounds,
                        "loss_norm_length": self.loss_norm_length,
                        "dynamic_sampling_prompts": self.dynamic_sampling_prompts}
        for name, value in at_least_one.items():
            if value is not None and value < 1:
                raise ValueError(f"flexrl.rl.{name}: must be at least 1, got {value}")
        if self.overlong_buffer_length < 0:
            raise ValueError("flexrl.rl.overlong_buffer_length: must be >= 0 (0: off), "
                             f"got {self.overlong_buffer_length}")
        if self.kl_target is not None and self.init_kl_coef == 0:
            raise ValueError("flexrl.rl.kl_target: the adaptive KL controller scales init_kl_coef, which is 0")
