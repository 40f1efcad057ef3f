"""One GSPO optimizer step on 4 gloo ranks equals the same step by plain single-process HF.

GSPO's ratio is one per sequence, exp(mean over the sequence's response tokens of logprob - old): on
the "mixed" plan sequences are cut over the ranks of degree-2 and degree-4 packs, so each rank's
piece sums are all-reduced (with their gradient) before the ratio (models/policy_update.py
`sequence_mean_log_ratios`). Reference: HF `model.forward` per sample, the loss as a loop over
sequences and tokens, torch's clip and AdamW (test_grpo_update.py's set-up and rollouts).
"""

from __future__ import annotations

import math

import pytest
import torch

from test_grpo_update import (CLIP, EPS, LR, RL, BETAS, WEIGHT_DECAY, _inputs, _load, assets,  # noqa: F401
                              fixed_values, make_plan, rank_grpo_step, rollouts)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
GSPO = {**RL, "policy_loss": "gspo", "loss_reduction": "sequence_mean", "eps_clip_low": 0.05, "eps_clip_high": 0.08}


def reference_gspo_step(model_dir: str, samples: dict, values: dict, rl: dict):
    model = _load(model_dir)
    per_sequence, clipped = [], []
    for seq_id, sample in samples.items():
        logits = model(**_inputs(model, sample)).logits[0].float()
        logp_all = torch.log_softmax(logits[:-1], dim=-1)[sample.response_start - 1:]
        targets = sample.input_ids[sample.response_start:]
        lps = [logp_all[t, targets[t]] for t in range(targets.shape[0])]
        ratio = torch.exp(sum(lp - values["old"][seq_id][t] for t, lp in enumerate(lps)) / len(lps))
        adv = values["adv"][seq_id]
        terms = []
        for t, lp in enumerate(lps):
            bounded = ratio.clamp(1 - rl["eps_clip_low"], 1 + rl["eps_clip_high"])
            pg = -torch.min(ratio * adv, bounded * adv)
            clipped.append(float((bounded * adv).detach()) < float((ratio * adv).detach()))
            if adv < 0:
                pg = torch.clamp(pg, max=-rl["dual_clip"] * adv)
            log_ratio = lp - values["ref"][seq_id][t]
            kl = (torch.exp(-log_ratio) - 1 + log_ratio).clamp(-10.0, 10.0)
            entropy = -(logp_all[t].exp() * logp_all[t]).sum()
            terms.append(pg + rl["init_kl_coef"] * kl - rl["entropy_coef"] * entropy)
        per_sequence.append(sum(terms) / len(terms))
    loss = sum(per_sequence) / len(per_sequence)
    loss.backward()
    params = list(model.parameters())
    norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in params if p.grad is not None))
    torch.nn.utils.clip_grad_norm_(params, CLIP)
    torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY).step()
    return float(loss.detach()), norm, {name: p.detach() for name, p in model.named_parameters()}, \
        sum(clipped) / len(clipped)


def test_gspo_step_with_sequences_cut_over_ranks_equals_plain_hf(assets, dist_pools):  # noqa: F811 (fixture)
    model_dir, data_path = assets
    samples = rollouts(model_dir, data_path, with_tiny=False)
    plan = make_plan(list(samples), "mixed")
    assert any(pack.degree > 1 for pack in plan.packs)
    values = fixed_values(model_dir, samples)
    per_rank = dist_pools(4).run(rank_grpo_step, model_dir, data_path, [plan.to_json()], values, GSPO, "none",
                                 False, timeout_s=240)
    ref_loss, ref_norm, ref_params, ref_clip = reference_gspo_step(model_dir, samples, values, GSPO)
    metrics = per_rank[0]["metrics"]
    assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert metrics["clip_frac"] == pytest.approx(ref_clip, abs=1e-6) and 0 < ref_clip < 1
    assert per_rank[0]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
    for name, expected in ref_params.items():
        torch.testing.assert_close(per_rank[0]["params"][name], expected, atol=2e-6, rtol=1e-5, msg=name)
