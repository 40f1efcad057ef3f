"""lm_head over the response rows only (FlexUlyssesLM._response_outputs): the log-probs, entropies, the
GRPO loss and every parameter's gradient equal those of the full-head computation (every local row
through lm_head, as before), and lm_head sees exactly the response rows."""

from __future__ import annotations

import copy

import torch

from flexrl_ds.models.flex_model import FlexUlyssesLM, build_step_batch, positions_fn
from flexrl_ds.models.loading import load_model
from flexrl_ds.models.policy_update import denominators, local_response_values, rank_grpo_loss
from flexrl_ds.models.sample_data import random_plan_for
from flexrl_ds.rl.config import GRPOConfig
from flexrl_ds.tools.logprobs import encode_dataset


class FullHeadLM(FlexUlyssesLM):
    """The reference: every local row through lm_head (the computation before the response-row cut)."""

    def _response_outputs(self, hidden, batch, with_entropy, entropy_grad=True):
        return self._token_outputs(hidden, batch.targets.to(hidden.device), with_entropy, entropy_grad)


def _run(module_class, model, batch, samples, entropy_grad: bool):
    rows_seen = []
    handle = model.lm_head.register_forward_hook(lambda _m, args, _out: rows_seen.append(args[0].shape[0]))
    outputs = module_class(model, logits_chunk=6)(batch, with_entropy=True, entropy_grad=entropy_grad)
    handle.remove()
    generator = torch.Generator().manual_seed(7)
    advantages = {name: float(torch.randn((), generator=generator)) for name in sorted(samples)}
    old = outputs.logprobs.detach() + 0.05 * torch.randn(outputs.logprobs.shape, generator=generator)
    config = GRPOConfig(entropy_coef=0.01 if entropy_grad else 0.0, init_kl_coef=0.0)
    loss, stats = rank_grpo_loss(outputs, batch, old, None, local_response_values(batch, advantages), config,
                                 denominators({n: s.length - s.response_start for n, s in samples.items()}), 1)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return outputs, float(loss.detach()), stats, grads, sum(rows_seen)


def test_response_rows_only_equal_the_full_head(tiny_assets):
    samples = encode_dataset(tiny_assets["vl"], tiny_assets["data"])
    base = load_model(tiny_assets["vl"])
    plan = random_plan_for({s: x.length for s, x in samples.items()}, 1, 1, seed=0)
    batch = build_step_batch(base.config, plan, samples, 0, positions=positions_fn(base))
    mask = batch.response_mask
    assert 0 < int(mask.sum()) < mask.numel() // 2  # most rows are prompt and vision rows here
    for entropy_grad in (True, False):
        full = _run(FullHeadLM, copy.deepcopy(base), batch, samples, entropy_grad)
        cut = _run(FlexUlyssesLM, copy.deepcopy(base), batch, samples, entropy_grad)
        for got, expected in ((cut[0].logprobs, full[0].logprobs), (cut[0].entropy, full[0].entropy)):
            torch.testing.assert_close(got.detach()[mask], expected.detach()[mask], atol=1e-6, rtol=1e-6)
            assert not got.detach()[~mask].any()  # the rows lm_head skipped hold 0
        assert abs(cut[1] - full[1]) <= 1e-6 * max(1.0, abs(full[1]))
        assert cut[2].num_tokens == full[2].num_tokens == int(mask.sum())
        assert cut[3].keys() == full[3].keys() and len(cut[3]) == len(list(base.parameters()))
        for name, grad in full[3].items():
            torch.testing.assert_close(cut[3][name], grad, atol=1e-6, rtol=1e-5, msg=name)
        # the forward's lm_head calls covered the response rows only (the full head: every row)
        assert cut[4] == int(mask.sum()) and full[4] == mask.numel()


def test_a_batch_without_response_rows_still_reaches_every_parameter(tiny_assets):
    """A rank whose local rows are all prompt (possible under sequence parallelism) runs lm_head on
    no row; the zero term still gives every parameter a (zero) gradient, as ZeRO-3 needs."""
    samples = encode_dataset(tiny_assets["vl"], tiny_assets["data"])
    model = load_model(tiny_assets["vl"])
    plan = random_plan_for({s: x.length for s, x in samples.items()}, 1, 1, seed=0)
    batch = build_step_batch(model.config, plan, samples, 0, positions=positions_fn(model))
    batch.response_mask = torch.zeros_like(batch.response_mask)
    outputs = FlexUlyssesLM(model, logits_chunk=6)(batch, with_entropy=True)
    assert not outputs.logprobs.any() and outputs.logprobs.shape == batch.response_mask.shape
    (outputs.logprobs.sum() + outputs.zero).backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
