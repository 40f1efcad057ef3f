"""The driver's GRPO pieces between the rollout and the update (trainer/driver.py calls them).

- `resolved_rl`: the `flexrl.rl` settings that depend on other sections, filled and checked before
  any worker starts (loss_norm_length, dynamic_sampling_prompts, the overlong buffer).
- `shape_rewards`: DAPO's overlong penalty added to the reward function's scores (rl/shaping.py).
- `sample_advantages`: the group estimator over the samples kept for training.
- `DynamicSampling`: DAPO's dynamic sampling over rollout rounds. The loader's `global_batch`
  prompts of a step are its pool; round 1 rolls out `dynamic_sampling_prompts` of them, each later
  round as many more as groups are still missing, until that many groups with unequal rewards are
  kept or `dynamic_sampling_max_rounds` rounds (or the pool) are used up; groups whose rewards are
  all equal are dropped (their advantages would be 0). A step that keeps no group trains on its
  first round's groups (all-zero advantages: only the KL and entropy terms act), and says so.
- `mini_batch_prompts`: the prompt order of one epoch's mini-batches (shuffled from (seed, step,
  epoch) only, so a resumed run deals the same mini-batches).
- `token_shaping`: the per-token inputs of the update computed from the log-prob passes: the TIS
  weights (rl/correction.py) and the `kl_in_reward` advantages (rl/advantages.kl_reward_advantages).
- `skips_old_pass`: when the old-policy log-prob pass is not needed (flexrl.rl.old_logprob_pass).
- `KLCoefficient`: the KL coefficient of a run, fixed or adaptive, saved beside each checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from flexrl_ds.rl.advantages import group_advantages, kl_reward_advantages
from flexrl_ds.rl.correction import sample_tis_weights
from flexrl_ds.rl.shaping import AdaptiveKLController, overlong_penalty
from flexrl_ds.trainer.samples import StepSamples

RL_STATE_FILE = "rl_state.json"
"""Beside a checkpoint's trainer state: the adaptive KL coefficient (`KLCoefficient`)."""


def resolved_rl(flexrl: Any) -> Any:
    """`flexrl.rl` with its defaults that come from other sections filled in, checked."""
    rl, max_length = flexrl.rl, flexrl.rollout.max_response_length
    global_batch = flexrl.data.loader.global_batch
    rl = dataclasses.replace(rl, loss_norm_length=rl.loss_norm_length or max_length,
                             dynamic_sampling_prompts=rl.dynamic_sampling_prompts or max(global_batch // 2, 1))
    if rl.overlong_buffer_length > max_length:
        raise ValueError(f"flexrl.rl.overlong_buffer_length: {rl.overlong_buffer_length} is more than "
                         f"flexrl.rollout.max_response_length {max_length}")
    if rl.dynamic_sampling and rl.dynamic_sampling_prompts > global_batch:
        raise ValueError(f"flexrl.rl.dynamic_sampling_prompts: {rl.dynamic_sampling_prompts} groups a step, more "
                         f"than the {global_batch} prompts the loader draws for it (flexrl.data.loader.global_batch)")
    trained = rl.dynamic_sampling_prompts if rl.dynamic_sampling else global_batch
    if rl.mini_batches_per_step > trained:
        raise ValueError(f"flexrl.rl.mini_batches_per_step: {rl.mini_batches_per_step} for the {trained} prompts a "
                         "step trains on")
    return rl


def shape_rewards(scores: Sequence[float], lengths: Sequence[int], rl: Any, max_length: int) -> tuple[list, list]:
    """(rewards, overlong penalties): the reward function's `scores` plus the overlong penalty."""
    penalties = [overlong_penalty(length, max_length, rl.overlong_buffer_length, rl.overlong_penalty_factor)
                 for length in lengths]
    return [score + penalty for score, penalty in zip(scores, penalties)], penalties


def sample_advantages(rewards: dict[str, float], names: Sequence[str], n: int, rl: Any) -> dict[str, float]:
    """The group estimator's advantage of each sample (prompt-major `names`, groups of n)."""
    values = torch.tensor([rewards[name] for name in names], dtype=torch.float64)
    advantages = group_advantages(values, n, rl.advantage_estimator, rl.advantage_eps, std_norm=not rl.no_std_norm,
                                  reward_clip=rl.reward_clip, advantage_clip=rl.advantage_clip)
    return dict(zip(names, advantages.tolist()))


def equal_reward_groups(prompts: Sequence[Any], rewards: dict[str, float]) -> set[str]:
    """Names of the prompts whose samples' rewards are all equal."""
    return {p.name for p in prompts if len({rewards[name] for name in p.sample_names if name in rewards}) <= 1}


@dataclass
class DynamicSampling:
    """One step's dynamic sampling (module docstring); `run` drives the rounds."""

    target: int
    """Groups to keep (flexrl.rl.dynamic_sampling_prompts)."""
    max_rounds: int
    rounds: int = 0
    rolled_out: int = 0
    dropped: int = 0
    kept: list = field(default_factory=list)

    def run(self, prompts: Sequence[Any], roll: Callable[[list], Any]) -> list:
        """The prompts to train on. `roll(prompts)` rolls them out and scores them, returning the
        prompts that got responses and the set of those whose rewards are all equal."""
        pool, first = list(prompts), None
        while len(self.kept) < self.target and pool and self.rounds < self.max_rounds:
            batch, pool = pool[:self.target - len(self.kept)], pool[self.target - len(self.kept):]
            done, equal = roll(batch)
            first = done if first is None else first
            self.rounds += 1
            self.rolled_out += len(done)
            self.dropped += len(equal)
            self.kept += [p for p in done if p.name not in equal]
        if not self.kept:
            self.kept = list(first or [])
        return self.kept

    def metrics(self) -> dict[str, float]:
        return {"rounds": float(self.rounds), "groups_rolled_out": float(self.rolled_out),
                "groups_dropped": float(self.dropped), "groups_kept": float(len(self.kept)),
                "dropped_frac": self.dropped / max(self.rolled_out, 1)}


def merge_rounds(kept: list, parts: Sequence[tuple[StepSamples, dict]]) -> tuple[StepSamples, dict[str, Any]]:
    """The samples of the `kept` prompts from the rounds' (samples, reward info) `parts`, and the
    rounds' reward info together (texts and penalties of every sample, the errors counted)."""
    samples = StepSamples(list(kept), {}, {}, {})
    reward_info: dict[str, Any] = {"texts": {}, "num_reward_errors": 0, "penalties": {}}
    for part, scored in parts:
        for name in ("response_ids", "engine_logprobs", "finish_reasons", "rewards"):
            getattr(samples, name).update(getattr(part, name))
        reward_info["num_reward_errors"] += scored["num_reward_errors"]
        reward_info["texts"].update(scored["texts"])
        reward_info["penalties"].update(scored["penalties"])
    return samples, reward_info


def mini_batch_prompts(prompts: Sequence[Any], seed: int, step: int, epoch: int, shuffle: bool) -> list:
    """The prompts in the order an epoch deals them into mini-batches."""
    order = list(prompts)
    if shuffle:
        random.Random(f"flexrl-minibatch/{seed}/{step}/{epoch}").shuffle(order)
    return order


def skips_old_pass(rl: Any, num_mini_batches: int) -> bool:
    """With one mini-batch and one epoch the update's first (only) forward is the old policy's, so
    the old-policy pass can go, unless the driver needs its log-probs before the update (TIS, KL in
    the reward, the adaptive KL controller)."""
    return (rl.old_logprob_pass == "auto" and num_mini_batches == 1 and rl.ppo_epochs == 1
            and rl.tis_level == "off" and not rl.kl_in_reward and rl.kl_target is None)


@dataclass
class TokenShaping:
    """The per-token update inputs the driver computes from the log-prob passes."""

    advantages: dict[str, Any]
    """Per sample: its advantage, or (kl_in_reward) one per response token."""
    is_weights: dict[str, list[float]]
    """Per sample, the TIS weights (empty: no correction)."""
    metrics: dict[str, float]


def token_shaping(names: Sequence[str], advantages: dict[str, float], old: dict[str, list], ref: dict[str, list],
                  engine_logprobs: dict[str, list], rl: Any, kl_coef: float) -> TokenShaping:
    """TIS weights (old policy vs engine) and kl_in_reward advantages (k1 = old - reference)."""
    metrics: dict[str, float] = {}
    weights: dict[str, list[float]] = {}
    if rl.tis_level != "off":
        weights, stats = sample_tis_weights(old, engine_logprobs, names, rl.tis_level, rl.tis_cap)
        metrics.update(tis_weight_mean=stats.weight_mean, tis_weight_max=stats.weight_max,
                       tis_clipped_frac=stats.clipped_frac)
    shaped: dict[str, Any] = dict(advantages)
    if ref and old:  # (no old log-probs yet where the update gives them: `skips_old_pass`)
        k1 = {name: [a - b for a, b in zip(old[name], ref[name])] for name in names}
        tokens = max(sum(len(v) for v in k1.values()), 1)
        metrics["kl_k1"] = sum(sum(v) for v in k1.values()) / tokens
        if rl.kl_in_reward:
            shaped = {name: kl_reward_advantages(advantages[name], k1[name], kl_coef) for name in names}
            metrics["kl_reward_mean"] = sum(-kl_coef * sum(k1[name]) for name in names) / max(len(names), 1)
    return TokenShaping(shaped, weights, metrics)


class KLCoefficient:
    """The run's KL coefficient: flexrl.rl.init_kl_coef, adapted after each step when kl_target is set."""

    def __init__(self, rl: Any):
        self.controller = (AdaptiveKLController(rl.init_kl_coef, rl.kl_target, rl.kl_horizon)
                           if rl.kl_target is not None else None)
        self.fixed = rl.init_kl_coef

    @property
    def value(self) -> float:
        return self.controller.coef if self.controller else self.fixed

    def update(self, measured_kl: float | None, num_samples: int) -> None:
        if self.controller is not None and measured_kl is not None:
            self.controller.update(measured_kl, num_samples)

    def save(self, checkpoint: Path) -> None:
        if self.controller is not None:
            (checkpoint / RL_STATE_FILE).write_text(json.dumps({"kl_coef": self.controller.coef}) + "\n")

    def load(self, checkpoint: Path | None) -> None:
        """The coefficient saved beside `checkpoint` (a resumed run goes on from it)."""
        path = None if checkpoint is None else checkpoint / RL_STATE_FILE
        if self.controller is not None and path is not None and path.is_file():
            self.controller.coef = float(json.loads(path.read_text())["kl_coef"])
