"""GSPO, TIS, kl_in_reward, token-meaned KL, the token-sum reductions: each against a plain per-token
Python loop (scalar torch ops, so that its gradient is autograd's of the loop), values and gradients;
TIS weights against a hand computation where the engine's and the trainer's log-probs differ."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexrl_ds.rl.config import GRPOConfig
from flexrl_ds.rl.correction import sample_tis_weights, tis_weights
from flexrl_ds.rl.losses import grpo_loss, reduce_masked, sequence_log_ratio_sums

NORM_LENGTH = 9


def loop_kl(lp, ref, estimator: str, clamp):
    d = lp - ref
    value = d if estimator == "k1" else d * d / 2 if estimator == "k2" else torch.exp(-d) - 1 + d
    return value if clamp is None else torch.clamp(value, -clamp, clamp)


def loop_reduce(rows: list[list], reduction: str):
    """rows: per sequence, its tokens' values (scalar tensors); empty rows are all-masked sequences."""
    live = [row for row in rows if row]
    if reduction == "token_mean":
        flat = [v for row in live for v in row]
        return sum(flat) / len(flat)
    if reduction == "sequence_mean":
        return sum(sum(row) / len(row) for row in live) / len(live)
    if reduction == "seq_mean_token_sum":
        return sum(sum(row) for row in live) / len(live)
    return sum(sum(row) / NORM_LENGTH for row in live) / len(live)


def loop_loss(lp, old, adv, ref, mask, weights, config: GRPOConfig):
    """The whole loss by loops over sequences and tokens."""
    pg_rows, kl_rows = [], []
    for s in range(len(mask)):
        tokens = [t for t in range(len(mask[s])) if mask[s][t]]
        if config.policy_loss == "gspo" and tokens:
            seq_ratio = torch.exp(sum(lp[s][t] - old[s][t] for t in tokens) / len(tokens))
        pg_row, kl_row = [], []
        for t in tokens:
            ratio = seq_ratio if config.policy_loss == "gspo" else torch.exp(lp[s][t] - old[s][t])
            clipped = torch.clamp(ratio, 1 - config.eps_clip_low, 1 + config.eps_clip_high)
            objective = torch.minimum(ratio * adv[s], clipped * adv[s])
            if config.dual_clip is not None and adv[s] < 0:
                objective = torch.maximum(objective, torch.tensor(config.dual_clip * adv[s], dtype=lp.dtype))
            pg_row.append(-objective * (1.0 if weights is None else weights[s][t]))
            kl_row.append(loop_kl(lp[s][t], ref[s][t], config.kl_estimator, config.kl_clamp))
        pg_rows.append(pg_row)
        kl_rows.append(kl_row)
    loss = loop_reduce(pg_rows, config.loss_reduction)
    if config.init_kl_coef > 0 and not config.kl_in_reward:
        kl_reduction = "token_mean" if config.kl_entropy_reduction == "token_mean" else config.loss_reduction
        loss = loss + config.init_kl_coef * loop_reduce(kl_rows, kl_reduction)
    return loss


def inputs(num_seqs: int, length: int, seed: int, bits=None):
    generator = torch.Generator().manual_seed(seed)
    old = -torch.rand(num_seqs, length, generator=generator, dtype=torch.float64) * 3
    lp = old + torch.randn(num_seqs, length, generator=generator, dtype=torch.float64) * 0.3
    ref = old + torch.randn(num_seqs, length, generator=generator, dtype=torch.float64) * 0.3
    adv = torch.randn(num_seqs, generator=generator, dtype=torch.float64)
    weights = torch.rand(num_seqs, length, generator=generator, dtype=torch.float64) * 2
    mask = torch.ones(num_seqs, length, dtype=torch.bool) if bits is None else torch.tensor(bits).reshape(num_seqs, length)
    mask[0, 0] = True
    return lp, old, ref, adv, weights, mask


configs = st.builds(
    GRPOConfig,
    eps_clip_low=st.sampled_from([0.1, 0.2]), eps_clip_high=st.sampled_from([0.2, 0.28]),
    dual_clip=st.sampled_from([None, 3.0]), init_kl_coef=st.sampled_from([0.0, 0.05]),
    kl_estimator=st.sampled_from(["k1", "k2", "k3"]), kl_clamp=st.sampled_from([None, 0.05]),
    loss_reduction=st.sampled_from(["token_mean", "sequence_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]),
    kl_in_reward=st.booleans(), kl_entropy_reduction=st.sampled_from(["loss", "token_mean"]),
)


@settings(max_examples=80, deadline=None)
@given(config=configs, gspo=st.booleans(), tis=st.booleans(), num_seqs=st.integers(1, 4), length=st.integers(1, 6),
       data=st.data())
def test_loss_and_gradient_match_the_loop(config, gspo, tis, num_seqs, length, data):
    if gspo:
        config = GRPOConfig(**{**config.__dict__, "policy_loss": "gspo", "loss_reduction": "sequence_mean"})
    bits = data.draw(st.lists(st.booleans(), min_size=num_seqs * length, max_size=num_seqs * length))
    lp, old, ref, adv, weights, mask = inputs(num_seqs, length, data.draw(st.integers(0, 2**31)), bits)
    lp.requires_grad_()
    loss, _ = grpo_loss(lp, old, adv, mask, config, ref_logprobs_SL=ref, norm_length=NORM_LENGTH,
                        is_weights_SL=weights if tis else None)
    expected = loop_loss(lp, old, adv.tolist(), ref, mask.tolist(), weights.tolist() if tis else None, config)
    assert math.isclose(float(loss.detach()), float(expected.detach()), rel_tol=1e-9, abs_tol=1e-12)
    (grad,) = torch.autograd.grad(loss, lp)
    (expected_grad,) = torch.autograd.grad(expected, lp, allow_unused=True)
    torch.testing.assert_close(grad, torch.zeros_like(lp) if expected_grad is None else expected_grad,
                               rtol=1e-9, atol=1e-12)


def test_kl_in_reward_leaves_the_kl_out_of_the_loss():
    lp, old, ref, adv, _, mask = inputs(3, 5, seed=1)
    plain = grpo_loss(lp, old, adv, mask, GRPOConfig(init_kl_coef=0.0))[0]
    in_reward = grpo_loss(lp, old, adv, mask, GRPOConfig(init_kl_coef=0.5, kl_in_reward=True))[0]  # no ref needed
    assert float(in_reward) == float(plain)


def test_token_sum_reductions_by_hand():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert float(reduce_masked(values, mask, "seq_mean_token_sum")) == (6 + 4) / 2
    assert float(reduce_masked(values, mask, "seq_mean_token_sum_norm", norm_length=4)) == (6 + 4) / (2 * 4)
    assert float(reduce_masked(values, mask, "seq_mean_token_sum", denominator=5)) == 10 / 5
    with pytest.raises(ValueError, match="norm_length"):
        reduce_masked(values, mask, "seq_mean_token_sum_norm")


def test_gspo_rows_of_pieces_take_their_sequences_ratio():
    """A sequence cut into two rows (as over two ranks) gives the uncut loss when each row gets the
    whole sequence's mean log-ratio (what the ranks all-reduce from `sequence_log_ratio_sums`)."""
    config = GRPOConfig(policy_loss="gspo", loss_reduction="sequence_mean", init_kl_coef=0.0)
    lp, old, _, adv, _, mask = inputs(1, 6, seed=4)
    whole = grpo_loss(lp, old, adv, mask, config)[0]
    rows = lambda t: torch.stack([t[0, :2], t[0, 2:4]])  # noqa: E731
    pieces_lp, pieces_old, pieces_mask = rows(lp), rows(old), rows(mask)
    mean_log_ratio = sequence_log_ratio_sums(pieces_lp, pieces_old, pieces_mask).sum() / 4
    pieces = grpo_loss(pieces_lp, pieces_old, adv.expand(2), pieces_mask, config,
                       denominator=1, sequence_num_tokens_S=torch.tensor([4.0, 4.0]),
                       sequence_log_ratio_S=mean_log_ratio.expand(2))[0]
    cut = grpo_loss(lp[:, :4], old[:, :4], adv, mask[:, :4], config)[0]
    assert float(pieces) == pytest.approx(float(cut), rel=1e-12)
    assert float(whole) != pytest.approx(float(cut))  # the rows' own ratios would not give it


def test_tis_weights_by_hand():
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -3.5, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    # token: exp(0.5), exp(-1), exp(0) | exp(0.1), exp(0.5) -> cap 1.5 truncates exp(0.5) = 1.6487 twice
    weights, stats = tis_weights(old, rollout, mask, "token", cap=1.5)
    expected = [[1.5, math.exp(-1), 1.0], [math.exp(0.1), 1.5, 0.0]]
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=torch.float64))
    assert stats.clipped_frac == pytest.approx(2 / 5)
    assert stats.weight_max == pytest.approx(math.exp(0.5))
    assert stats.weight_mean == pytest.approx((1.5 + math.exp(-1) + 1 + math.exp(0.1) + 1.5) / 5)
    # sequence: exp(0.5 - 1 + 0) = exp(-0.5), exp(0.1 + 0.5) = exp(0.6) = 1.822 -> 1.5
    weights, stats = tis_weights(old, rollout, mask, "sequence", cap=1.5)
    expected = [[math.exp(-0.5)] * 3, [1.5, 1.5, 0.0]]
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=torch.float64))
    assert (stats.clipped_frac, stats.weight_max) == (0.5, pytest.approx(math.exp(0.6)))
    assert stats.weight_mean == pytest.approx((math.exp(-0.5) + 1.5) / 2)
    by_name, _ = sample_tis_weights({"a": [-1.0, -2.0, -0.5], "b": [-0.1, -3.0]},
                                    {"a": [-1.5, -1.0, -0.5], "b": [-0.2, -3.5]}, ["a", "b"], "token", 1.5)
    assert by_name["b"] == pytest.approx([math.exp(0.1), 1.5]) and len(by_name["a"]) == 3


def test_tis_weights_scale_each_tokens_policy_gradient():
    """With the engine and trainer log-probs different, the weighted loss's gradient at a token is the
    weight times the unweighted one (the weights are constants)."""
    lp, old, _, adv, _, mask = inputs(2, 4, seed=7)
    rollout = old + 0.3 * torch.randn(2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    config = GRPOConfig(init_kl_coef=0.0, tis_level="token", tis_cap=1.2)
    weights, _ = tis_weights(old, rollout, mask, "token", config.tis_cap)
    lp.requires_grad_()
    (weighted,) = torch.autograd.grad(grpo_loss(lp, old, adv, mask, config, is_weights_SL=weights)[0], lp)
    (plain,) = torch.autograd.grad(grpo_loss(lp, old, adv, mask, config)[0], lp)
    torch.testing.assert_close(weighted, plain * weights)
    assert not torch.allclose(weights, torch.ones_like(weights))
