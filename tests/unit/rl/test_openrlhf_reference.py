"""rl/ against OpenRLHF 0.11.2's own loss code (loaded by file: openrlhf_reference.py), on random
right-padded batches: values and gradients of every loss, KL estimator, aggregation and correction
the two share. Where flexrl_ds deliberately differs, the test says how and checks the difference.

Shared and compared: PPO-clip (clip-higher, dual clip), token and sequence mean (with global
denominators and the data-parallel factor), k1/k2/k3 with the +-10 clamp, GSPO, token-level TIS
(OpenRLHF's is_correction mode "clip" with the ratio gate), KL in the reward.
Differences, each tested as such:
- k3 bounds its exponent at -20 (OpenRLHF: -10) before exp; both clamp the value at 10, so they
  differ only where the value is clamped anyway, and there both pass no gradient;
- sequence-level TIS: OpenRLHF's "seq" level is a rejection filter (a sequence whose geometric-mean
  ratio leaves the band is dropped, the others keep per-token weights); flexrl_ds follows veRL's
  sequence TIS (one truncated product weight per sequence). Where no sequence is rejected,
  OpenRLHF's weights are the untruncated token-level weights, which flexrl_ds's token level gives;
- reinforce_baseline whitens over samples with Bessel's std; OpenRLHF's masked_normalize over
  tokens with the plain std (equal lengths: a factor sqrt((N-1)/N), checked);
- equal-reward groups: flexrl_ds pins their advantages to exactly 0 (rl/advantages.py); OpenRLHF's
  group estimators live in its experience maker, not in these files, and are not compared;
- OpenRLHF's KL `unbiased_gradient` straight-through option and its entropy from logits have no
  flexrl_ds counterpart here (the entropy comes from the model's forward).
"""

from __future__ import annotations

import math

import pytest
import torch

from flexrl_ds.rl.advantages import group_advantages, kl_reward_advantages
from flexrl_ds.rl.config import GRPOConfig
from flexrl_ds.rl.correction import tis_weights
from flexrl_ds.rl.losses import approx_kl, grpo_loss, reduce_masked

openrlhf_reference = pytest.importorskip("openrlhf_reference")
if openrlhf_reference.openrlhf_models_dir() is None:
    pytest.skip("openrlhf is not installed (pip install --no-deps openrlhf==0.11.2)", allow_module_level=True)

LOSS, UTILS = openrlhf_reference.load_openrlhf_losses()


def test_the_reference_is_the_pinned_version():
    assert openrlhf_reference.installed_version() == openrlhf_reference.VERSION


def padded_batch(seed: int, num_seqs: int = 5, length: int = 7):
    """Right-padded rows (every row at least one token), padding holding finite junk."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (num_seqs,), generator=generator)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    old = -torch.rand(num_seqs, length, generator=generator, dtype=torch.float64) * 3
    logprobs = old + torch.randn(num_seqs, length, generator=generator, dtype=torch.float64) * 0.4
    ref = old + torch.randn(num_seqs, length, generator=generator, dtype=torch.float64) * 0.3
    rollout = old + torch.randn(num_seqs, length, generator=generator, dtype=torch.float64) * 0.2
    advantages = torch.randn(num_seqs, generator=generator, dtype=torch.float64)
    return logprobs, old, ref, rollout, advantages, mask


def value_and_grad(function, logprobs):
    leaf = logprobs.clone().requires_grad_()
    value = function(leaf)
    (grad,) = torch.autograd.grad(value, leaf)
    return float(value.detach()), grad


SEEDS = range(6)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
@pytest.mark.parametrize("clips", [(0.2, 0.2, None), (0.2, 0.28, None), (0.1, 0.3, 3.0)])
def test_ppo_clip_loss(seed, reduction, clips):
    low, high, dual = clips
    logprobs, old, _, _, advantages, mask = padded_batch(seed)
    config = GRPOConfig(eps_clip_low=low, eps_clip_high=high, dual_clip=dual, init_kl_coef=0.0,
                        loss_reduction=reduction)
    theirs_fn = LOSS.PolicyLoss(clip_eps_low=low, clip_eps_high=high, dual_clip=dual,
                                token_level_loss=reduction == "token_mean")
    token_advantages = advantages[:, None].expand_as(mask)
    ours, our_grad = value_and_grad(lambda lp: grpo_loss(lp, old, advantages, mask, config)[0], logprobs)
    theirs, their_grad = value_and_grad(lambda lp: theirs_fn(lp, old, token_advantages, mask.double())[0], logprobs)
    # OpenRLHF's sequence mean divides by (length + 1e-8): a relative 1e-8 at most
    assert ours == pytest.approx(theirs, rel=1e-10 if reduction == "token_mean" else 1e-7, abs=1e-12)
    torch.testing.assert_close(our_grad, their_grad * mask, rtol=1e-7, atol=1e-12)
    _, stats = grpo_loss(logprobs, old, advantages, mask, config)
    their_clip = float(theirs_fn(logprobs, old, token_advantages, mask.double())[1])
    assert stats.clip_fraction == pytest.approx(their_clip)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_aggregation_with_global_denominators_and_dp_factor(seed, reduction):
    values, *_, mask = padded_batch(seed)
    token_level = reduction == "token_mean"
    for global_tokens, global_seqs, dp_size in ((None, None, 1), (31.0, 9.0, 4)):
        theirs = LOSS.aggregate_loss(values, mask.double(), token_level_loss=token_level, dp_size=dp_size,
                                     batch_num_tokens=global_tokens, global_batch_size=global_seqs)
        denominator = global_tokens if token_level else global_seqs
        ours = reduce_masked(values, mask, reduction, denominator=denominator) * dp_size
        assert float(ours) == pytest.approx(float(theirs), rel=1e-7)  # theirs adds 1e-8 to sequence lengths


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("seed", SEEDS)
def test_kl_estimators(estimator, seed):
    logprobs, _, ref, *_ = padded_batch(seed)
    logprobs = logprobs + torch.randn(logprobs.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    ours, our_grad = value_and_grad(lambda lp: approx_kl(lp, ref, estimator, clamp=10.0).sum(), logprobs)
    theirs, their_grad = value_and_grad(lambda lp: UTILS.compute_approx_kl(lp, ref, kl_estimator=estimator).sum(),
                                        logprobs)
    assert ours == pytest.approx(theirs, rel=1e-6)  # theirs computes in float32
    torch.testing.assert_close(our_grad, their_grad.double(), rtol=1e-5, atol=1e-6)


def test_k3_exponent_bound_differs_only_where_both_clamp():
    logprobs = torch.tensor([0.0, 0.0, 0.0], dtype=torch.float64)
    ref = torch.tensor([12.0, 15.0, 25.0], dtype=torch.float64)  # log-ratio -12, -15, -25: k3 past 10
    ours, our_grad = value_and_grad(lambda lp: approx_kl(lp, ref, "k3", clamp=10.0).sum(), logprobs)
    theirs, their_grad = value_and_grad(lambda lp: UTILS.compute_approx_kl(lp, ref, kl_estimator="k3").sum(), logprobs)
    assert ours == theirs == 30.0
    assert our_grad.abs().max() == their_grad.abs().max() == 0.0


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_loss_term_token_meaned_as_openrlhf(seed):
    """OpenRLHF reduces its KL loss by token mean whatever the policy loss's level; so does
    kl_entropy_reduction "token_mean" under sequence_mean."""
    logprobs, old, ref, _, advantages, mask = padded_batch(seed)
    config = GRPOConfig(init_kl_coef=0.1, kl_estimator="k3", loss_reduction="sequence_mean",
                        kl_entropy_reduction="token_mean")
    theirs_pg = LOSS.PolicyLoss(token_level_loss=False)

    def theirs_fn(lp):
        kl = UTILS.compute_approx_kl(lp, ref, kl_estimator="k3")
        return theirs_pg(lp, old, advantages[:, None].expand_as(mask), mask.double())[0] + \
            0.1 * LOSS.aggregate_loss(kl, mask.double())

    ours, our_grad = value_and_grad(lambda lp: grpo_loss(lp, old, advantages, mask, config, ref_logprobs_SL=ref)[0],
                                    logprobs)
    theirs, their_grad = value_and_grad(theirs_fn, logprobs)
    assert ours == pytest.approx(theirs, rel=1e-6)  # their KL is float32
    torch.testing.assert_close(our_grad, their_grad.double() * mask, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("clips", [(0.2, 0.2), (3e-4, 4e-4), (0.05, 0.1)])
def test_gspo(seed, clips):
    low, high = clips
    logprobs, old, _, _, advantages, mask = padded_batch(seed)
    logprobs = old + (logprobs - old) * 0.1  # sequence ratios near the clip range
    config = GRPOConfig(policy_loss="gspo", loss_reduction="sequence_mean", eps_clip_low=low, eps_clip_high=high,
                        init_kl_coef=0.0)
    theirs_fn = LOSS.PolicyLoss(clip_eps_low=low, clip_eps_high=high, policy_loss_type="gspo")
    token_advantages = advantages[:, None].expand_as(mask)
    ours, our_grad = value_and_grad(lambda lp: grpo_loss(lp, old, advantages, mask, config)[0], logprobs)
    theirs, their_grad = value_and_grad(lambda lp: theirs_fn(lp, old, token_advantages, mask.double())[0], logprobs)
    assert ours == pytest.approx(theirs, rel=1e-7, abs=1e-12)
    torch.testing.assert_close(our_grad, their_grad * mask, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("cap", [1.05, 2.0])
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
def test_token_level_tis(seed, cap, reduction):
    logprobs, old, _, rollout, advantages, mask = padded_batch(seed)
    config = GRPOConfig(init_kl_coef=0.0, loss_reduction=reduction, tis_level="token", tis_cap=cap)
    weights, stats = tis_weights(old, rollout, mask, "token", cap)
    theirs_fn = LOSS.PolicyLoss(token_level_loss=reduction == "token_mean", is_correction_level="token",
                                is_correction_mode="clip", is_correction_gating="ratio",
                                is_correction_threshold=(0.0, cap))
    token_advantages = advantages[:, None].expand_as(mask)
    ours, our_grad = value_and_grad(lambda lp: grpo_loss(lp, old, advantages, mask, config, is_weights_SL=weights)[0],
                                    logprobs)
    theirs_out = theirs_fn(logprobs, old, token_advantages, mask.double(), rollout_log_probs=rollout)
    theirs, their_grad = value_and_grad(
        lambda lp: theirs_fn(lp, old, token_advantages, mask.double(), rollout_log_probs=rollout)[0], logprobs)
    assert ours == pytest.approx(theirs, rel=1e-7, abs=1e-12)
    torch.testing.assert_close(our_grad, their_grad * mask, rtol=1e-7, atol=1e-12)
    assert stats.clipped_frac == pytest.approx(float(theirs_out[4]))  # their "is_filter_ratio"


def test_sequence_tis_differs_openrlhf_filters_sequences():
    logprobs, old, _, rollout, advantages, mask = padded_batch(3)
    theirs_fn = LOSS.PolicyLoss(token_level_loss=True, is_correction_level="seq", is_correction_mode="mask",
                                is_correction_threshold=(1e-6, 1e6))  # a band no sequence leaves
    token_advantages = advantages[:, None].expand_as(mask)
    theirs = theirs_fn(logprobs, old, token_advantages, mask.double(), rollout_log_probs=rollout)[0]
    untruncated, _ = tis_weights(old, rollout, mask, "token", cap=1e6)
    config = GRPOConfig(init_kl_coef=0.0, tis_level="token", tis_cap=1e6)
    ours = grpo_loss(logprobs, old, advantages, mask, config, is_weights_SL=untruncated)[0]
    assert float(ours) == pytest.approx(float(theirs), rel=1e-9)
    sequence, _ = tis_weights(old, rollout, mask, "sequence", cap=1e6)
    product = torch.where(mask, old - rollout, 0.0).sum(-1).exp()
    torch.testing.assert_close(sequence[:, 0], product)  # veRL's: one product weight per sequence


@pytest.mark.parametrize("seed", SEEDS)
def test_kl_in_reward(seed):
    """OpenRLHF's compute_reward (reward at the last token, -kl_coef * k1 at each) summed from each
    token to the end (its cumulative returns with gamma 1) gives flexrl_ds's per-token advantages."""
    _, old, ref, _, advantages, mask = padded_batch(seed)
    kl = UTILS.compute_approx_kl(old, ref, kl_estimator="k1") * mask
    rewards = UTILS.compute_reward(advantages, 0.05, kl, action_mask=mask.double(), reward_clip_range=(-10.0, 10.0))
    for s in range(mask.shape[0]):
        n = int(mask[s].sum())
        returns = [float(rewards[s, t:n].sum()) for t in range(n)]
        ours = kl_reward_advantages(float(advantages[s]), (old[s, :n] - ref[s, :n]).tolist(), 0.05)
        assert ours == pytest.approx(returns, rel=1e-6, abs=1e-6)  # their k1 is float32


def test_reward_clip_range():
    rewards = torch.tensor([14.0, -12.0, 0.5, 3.0], dtype=torch.float64)
    mask = torch.ones(4, 1)
    theirs = UTILS.compute_reward(rewards, 0.0, torch.zeros(4, 1, dtype=torch.float64), action_mask=mask,
                                  reward_clip_range=(-10.0, 10.0))[:, 0]
    ours = group_advantages(rewards, 4, "dr_grpo", reward_clip=10.0)
    torch.testing.assert_close(ours, theirs - theirs.mean())


def test_reinforce_baseline_whitening_differs_by_bessels_factor():
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.25, 2.0, 0.0, 1.0, 1.5], dtype=torch.float64)
    centred = rewards.reshape(2, 4) - rewards.reshape(2, 4).mean(1, keepdim=True)
    theirs = UTILS.masked_normalize(centred.reshape(1, -1), torch.ones(1, 8, dtype=torch.float64), dim=1)[0]
    ours = group_advantages(rewards, 4, "reinforce_baseline")
    torch.testing.assert_close(ours, theirs * math.sqrt(7 / 8), rtol=1e-7, atol=1e-9)
