"""GRPO loss against an explicit per-token Python loop; gradcheck; masking and clip edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexrl_ds.rl.config import GRPOConfig
from flexrl_ds.rl.losses import approx_kl, grpo_loss, reduce_masked


def reference_kl(logprob: float, ref: float, estimator: str, clamp: float | None) -> float:
    if estimator == "k1":
        value = logprob - ref
    elif estimator == "k2":
        value = 0.5 * (logprob - ref) ** 2
    else:  # ratio r = p_ref / p: r - 1 - log r
        r = math.exp(ref - logprob)
        value = r - 1 - math.log(r)
    return value if clamp is None else min(max(value, -clamp), clamp)


def reference_token_loss(logprob, old, advantage, ref, config: GRPOConfig) -> float:
    ratio = math.exp(logprob - old)
    clipped = min(max(ratio, 1 - config.eps_clip_low), 1 + config.eps_clip_high)
    objective = min(ratio * advantage, clipped * advantage)
    if config.dual_clip is not None and advantage < 0:
        objective = max(objective, config.dual_clip * advantage)
    loss = -objective
    if config.init_kl_coef > 0:
        loss += config.init_kl_coef * reference_kl(logprob, ref, config.kl_estimator, config.kl_clamp)
    return loss


def reference_loss(logprobs, old, advantages, ref, mask, config: GRPOConfig) -> float:
    per_sequence = []
    for s in range(len(mask)):
        losses = [
            reference_token_loss(logprobs[s][t], old[s][t], advantages[s], ref[s][t], config)
            for t in range(len(mask[s])) if mask[s][t]
        ]
        per_sequence.append(losses)
    if config.loss_reduction == "token_mean":
        flat = [value for losses in per_sequence for value in losses]
        return sum(flat) / len(flat)
    means = [sum(losses) / len(losses) for losses in per_sequence if losses]
    return sum(means) / len(means)


configs = st.builds(
    GRPOConfig,
    eps_clip_low=st.sampled_from([0.1, 0.2]),
    eps_clip_high=st.sampled_from([0.2, 0.28]),
    dual_clip=st.sampled_from([None, 3.0]),
    init_kl_coef=st.sampled_from([0.0, 0.05]),
    kl_estimator=st.sampled_from(["k1", "k2", "k3"]),
    kl_clamp=st.sampled_from([None, 10.0, 0.05]),
    loss_reduction=st.sampled_from(["token_mean", "sequence_mean"]),
)


@settings(max_examples=80, deadline=None)
@given(config=configs, num_seqs=st.integers(1, 5), length=st.integers(1, 7), data=st.data())
def test_loss_matches_per_token_loop(config, num_seqs, length, data):
    bits = data.draw(st.lists(st.booleans(), min_size=num_seqs * length, max_size=num_seqs * length))
    mask = torch.tensor(bits).reshape(num_seqs, length)
    mask[0, 0] = True  # at least one token
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    old = -torch.rand(num_seqs, length, generator=generator, dtype=torch.float64) * 3
    logprobs = old + torch.randn(num_seqs, length, generator=generator, dtype=torch.float64) * 0.5
    ref = old + torch.randn(num_seqs, length, generator=generator, dtype=torch.float64) * 0.3
    advantages = torch.randn(num_seqs, generator=generator, dtype=torch.float64)
    loss, stats = grpo_loss(logprobs, old, advantages, mask, config, ref_logprobs_SL=ref)
    expected = reference_loss(logprobs.tolist(), old.tolist(), advantages.tolist(), ref.tolist(), mask.tolist(), config)
    assert math.isclose(float(loss), expected, rel_tol=1e-9, abs_tol=1e-12)
    assert stats.num_tokens == int(mask.sum())
    flat_mask = mask.flatten().tolist()
    ratios = [math.exp(a - b) for a, b, m in zip(logprobs.flatten().tolist(), old.flatten().tolist(), flat_mask) if m]
    assert math.isclose(stats.mean_ratio, sum(ratios) / len(ratios), rel_tol=1e-9)


def _random_inputs(num_seqs=3, length=4, seed=0):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(num_seqs, length, generator=generator, dtype=torch.float64) * 2
    logprobs = (old + torch.randn(num_seqs, length, generator=generator, dtype=torch.float64) * 0.4)
    ref = old + torch.randn(num_seqs, length, generator=generator, dtype=torch.float64) * 0.3
    advantages = torch.randn(num_seqs, generator=generator, dtype=torch.float64)
    mask = torch.ones(num_seqs, length, dtype=torch.bool)
    mask[1, 2:] = False
    return logprobs, old, ref, advantages, mask


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("reduction", ["token_mean", "sequence_mean"])
@pytest.mark.parametrize("dual_clip", [None, 2.0])
def test_gradcheck(estimator, reduction, dual_clip):
    logprobs, old, ref, advantages, mask = _random_inputs()
    config = GRPOConfig(kl_estimator=estimator, loss_reduction=reduction, dual_clip=dual_clip,
                        init_kl_coef=0.1, kl_clamp=None)

    def loss_of(lp):
        return grpo_loss(lp, old, advantages, mask, config, ref_logprobs_SL=ref)[0]

    assert torch.autograd.gradcheck(loss_of, (logprobs.clone().requires_grad_(),))


def test_padding_inf_and_nan_do_not_leak():
    logprobs, old, ref, advantages, mask = _random_inputs()
    config = GRPOConfig(kl_estimator="k3", init_kl_coef=0.1)
    clean_lp = logprobs.clone().requires_grad_()
    clean, _ = grpo_loss(clean_lp, old, advantages, mask, config, ref_logprobs_SL=ref)
    clean.backward()
    dirty = [t.clone() for t in (logprobs, old, ref)]
    for tensor, value in zip(dirty, (float("-inf"), float("nan"), float("inf"))):
        tensor[~mask] = value
    dirty_lp = dirty[0].requires_grad_()
    loss, _ = grpo_loss(dirty_lp, dirty[1], advantages, mask, config, ref_logprobs_SL=dirty[2])
    loss.backward()
    assert torch.equal(loss.detach(), clean.detach())
    assert torch.equal(dirty_lp.grad, clean_lp.grad)
    assert torch.equal(dirty_lp.grad[~mask], torch.zeros(int((~mask).sum()), dtype=torch.float64))


def test_all_masked_sequence_adds_nothing_to_either_reduction():
    logprobs, old, ref, advantages, mask = _random_inputs()
    config_seq = GRPOConfig(loss_reduction="sequence_mean", init_kl_coef=0.0)
    without, _ = grpo_loss(logprobs[[0, 2]], old[[0, 2]], advantages[[0, 2]], mask[[0, 2]], config_seq)
    mask[1] = False
    with_empty, _ = grpo_loss(logprobs, old, advantages, mask, config_seq)
    torch.testing.assert_close(with_empty, without)


def test_no_tokens_needs_an_explicit_denominator():
    logprobs, old, ref, advantages, mask = _random_inputs()
    mask[:] = False
    config = GRPOConfig(init_kl_coef=0.0)
    with pytest.raises(ValueError, match="no response tokens; pass an explicit denominator"):
        grpo_loss(logprobs, old, advantages, mask, config)
    lp = logprobs.clone().requires_grad_()
    loss, stats = grpo_loss(lp, old, advantages, mask, config, denominator=10)
    loss.backward()  # a rank whose slice holds no response tokens still joins the backward
    assert loss.item() == 0.0 and stats.num_tokens == 0 and torch.equal(lp.grad, torch.zeros_like(lp))


def test_ratio_far_outside_the_clip_range():
    mask = torch.ones(1, 4, dtype=torch.bool)
    old = torch.zeros(1, 4, dtype=torch.float64)
    # ratios e^3 (far above 1.2) and e^-3 (far below 0.8), for a positive and a negative advantage
    lp = torch.tensor([[3.0, -3.0, 3.0, -3.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    config = GRPOConfig(init_kl_coef=0.0, dual_clip=3.0)
    loss, stats = grpo_loss(lp, old, advantages, mask, config)
    loss.backward()
    e3 = math.exp(3)
    # A>0, r>>1: clipped at 1.2, no gradient; A>0, r<<1: unclipped (min picks r*A), gradient flows;
    # A<0, r>>1: -min(-r, -1.2) = r, then dual clip caps at c=3 (no gradient); A<0, r<<1: clipped at 0.8.
    expected_tokens = [-1.2, -math.exp(-3), 3.0, 0.8]
    assert math.isclose(loss.item(), sum(expected_tokens) / 4, rel_tol=1e-12)
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -math.exp(-3) / 4, 0.0, 0.0]], dtype=torch.float64))
    assert stats.clip_fraction == 0.5  # tokens 0 and 3 take the clipped branch
    assert stats.dual_clip_fraction == 0.25
    assert math.isclose(stats.mean_ratio, (2 * e3 + 2 / e3) / 4, rel_tol=1e-12)


@pytest.mark.parametrize("kl_clamp", [10.0, None])
def test_log_ratios_past_fp32_exp_range_give_finite_gradients(kl_clamp):
    """fp32 exp overflows past ~88.7: a token 95 nats below its reference (k3's exp(-log_ratio)) or 99
    above its old log-prob (the ratio) must not turn the whole gradient into NaN. Those tokens pass no
    gradient (clipped, clamped or past MAX_LOG_RATIO); the ordinary token's gradient is what it is alone."""
    config = GRPOConfig(init_kl_coef=0.05, kl_estimator="k3", kl_clamp=kl_clamp, dual_clip=None)
    old = torch.tensor([[-1.2, -1.0, -100.0]])
    ref = torch.tensor([[-0.9, -1.0, -1.0]])
    advantages = torch.tensor([[1.0, 1.0, 1.0]])
    lp = torch.tensor([[-1.0, -96.0, -1.0]], requires_grad=True)
    loss, stats = grpo_loss(lp, old, advantages, torch.ones(1, 3, dtype=torch.bool), config, ref_logprobs_SL=ref)
    loss.backward()
    assert math.isfinite(loss.item()) and math.isfinite(stats.approx_kl) and math.isfinite(stats.mean_ratio)
    assert torch.isfinite(lp.grad).all()
    alone = lp.detach()[:, :1].clone().requires_grad_(True)
    alone_loss, _ = grpo_loss(alone, old[:, :1], advantages[:, :1], torch.ones(1, 1, dtype=torch.bool), config,
                              ref_logprobs_SL=ref[:, :1], denominator=3)
    alone_loss.backward()
    torch.testing.assert_close(lp.grad[0, 0], alone.grad[0, 0])
    assert lp.grad[0, 2] == 0  # ratio e^99, positive advantage: the clipped branch
    # token 1's ratio e^-95 passes a gradient of ~1e-42; its k3 term is clamped (no gradient), or without
    # a clamp bounded at MAX_LOG_RATIO, leaving only the gradient of its linear term: init_kl_coef / 3
    expected = 0.0 if kl_clamp is not None else config.init_kl_coef / 3
    assert float(lp.grad[0, 1]) == pytest.approx(expected, rel=1e-5, abs=1e-30)


def test_on_policy_first_step_is_plain_policy_gradient():
    logprobs, _, _, advantages, mask = _random_inputs()
    config = GRPOConfig(init_kl_coef=0.0)
    loss, stats = grpo_loss(logprobs, logprobs.detach(), advantages, mask, config)
    tokens = advantages[:, None].expand_as(mask)[mask]
    torch.testing.assert_close(loss, -tokens.mean())
    assert stats.clip_fraction == 0.0 and stats.approx_kl == 0.0 and stats.mean_ratio == 1.0


def test_explicit_denominators_split_like_one_process():
    """Two 'ranks' holding halves of the tokens (one sequence split across them), each normalising
    by the global counts, sum to the single-call loss for both reductions."""
    logprobs, old, ref, advantages, mask = _random_inputs(num_seqs=3, length=6)
    for reduction in ("token_mean", "sequence_mean"):
        config = GRPOConfig(loss_reduction=reduction, kl_estimator="k3", init_kl_coef=0.05)
        whole, _ = grpo_loss(logprobs, old, advantages, mask, config, ref_logprobs_SL=ref)
        full_counts = mask.sum(dim=1)
        denominator = int(mask.sum()) if reduction == "token_mean" else int((full_counts > 0).sum())
        parts = [
            grpo_loss(logprobs[:, cols], old[:, cols], advantages, mask[:, cols], config,
                      ref_logprobs_SL=ref[:, cols], denominator=denominator, sequence_num_tokens_S=full_counts)[0]
            for cols in (slice(0, 2), slice(2, 6))
        ]
        torch.testing.assert_close(parts[0] + parts[1], whole)


def test_approx_kl_estimators():
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    ref = torch.tensor([-1.3, -2.0, -3.5], dtype=torch.float64)
    for estimator in ("k1", "k2", "k3"):
        values = approx_kl(lp, ref, estimator)
        expected = [reference_kl(a, b, estimator, None) for a, b in zip(lp.tolist(), ref.tolist())]
        torch.testing.assert_close(values, torch.tensor(expected, dtype=torch.float64))
    assert (approx_kl(lp, ref, "k3") >= 0).all() and float(approx_kl(lp, ref, "k3")[1]) == 0.0
    assert approx_kl(lp, ref, "k3", clamp=1.0).max() == 1.0
    with pytest.raises(ValueError, match="kl_estimator: 'k4' is not one of"):
        approx_kl(lp, ref, "k4")


def test_k3_is_an_unbiased_kl_estimate():
    """Sampling tokens from the policy, mean k3 (and k1) approaches the exact categorical KL."""
    generator = torch.Generator().manual_seed(0)
    policy = torch.softmax(torch.randn(6, generator=generator, dtype=torch.float64), 0)
    reference = torch.softmax(torch.randn(6, generator=generator, dtype=torch.float64), 0)
    exact = float((policy * (policy / reference).log()).sum())
    tokens = torch.multinomial(policy, 200_000, replacement=True, generator=generator)
    for estimator in ("k1", "k3"):
        estimate = float(approx_kl(policy.log()[tokens], reference.log()[tokens], estimator).mean())
        assert abs(estimate - exact) < 0.02 * max(exact, 0.1), (estimator, estimate, exact)


def test_input_errors_name_the_argument():
    logprobs, old, ref, advantages, mask = _random_inputs()
    with pytest.raises(ValueError, match="ref_logprobs: required when flexrl.rl.init_kl_coef > 0"):
        grpo_loss(logprobs, old, advantages, mask, GRPOConfig(init_kl_coef=0.1))
    with pytest.raises(ValueError, match=r"old_logprobs: shape \(3, 3\) differs from response_mask \(3, 4\)"):
        grpo_loss(logprobs, old[:, :3], advantages, mask, GRPOConfig(init_kl_coef=0.0))
    with pytest.raises(ValueError, match="denominator: must be positive"):
        reduce_masked(logprobs, mask, "token_mean", denominator=0)
    with pytest.raises(ValueError, match="loss_reduction: 'sum' is not one of"):
        reduce_masked(logprobs, mask, "sum")
