"""Adapter + positions + FlexUlyssesLM on one rank equal plain HF (VL and text models)."""

from __future__ import annotations

import pytest
import torch

from flexrl_ds.models.flex_model import (FlexUlyssesLM, build_step_batch, positions_fn, reference_inputs,
                                         reference_logprobs)
from flexrl_ds.models.sample_data import random_plan_for
from flexrl_ds.models.loading import load_model
from flexrl_ds.tools.logprobs import encode_dataset
from flexrl_ds.tools.logprob_worker import assemble
from flexrl_ds.models import hf_adapter
from flexrl_ds.models.positions import sequence_positions


def test_explicit_positions_are_what_the_model_uses(vl_samples):
    """The model honours the explicit position_ids reference_inputs gives (and they are 3-D)."""
    model, samples = vl_samples
    with torch.no_grad():
        for sample in samples.values():
            kwargs = reference_inputs(model, sample)
            positions = sequence_positions(model, sample.input_ids, sample.items)
            assert torch.equal(kwargs["position_ids"][:, 0], positions) and positions.shape == (3, sample.length)
            shifted = model(**{**kwargs, "position_ids": kwargs["position_ids"] + 5}).logits
            if sample.items:  # mRoPE is relative within a text run, not across vision blocks' 3 axes
                assert not torch.allclose(model(**kwargs).logits, shifted)
    video_sample = next(s for s in samples.values() if s.of_kind("video") and s.of_kind("image"))
    positions = sequence_positions(model, video_sample.input_ids, video_sample.items)
    assert not torch.equal(positions[0], positions[1])  # really 3-D


def _one_rank_logprobs(model, samples, plan, temperature: float = 1.0):
    batch = build_step_batch(model.config, plan, samples, 0, positions=positions_fn(model))
    flex = FlexUlyssesLM(model, logits_chunk=7, temperature=temperature)  # no grad: lm_head in chunks of 7 tokens
    with torch.no_grad():
        logprobs = flex(batch).logprobs
    pieces = {}
    for seq_id, lo, hi, local in batch.layout.segments():
        pieces.setdefault(seq_id, []).append((lo, logprobs[local:local + hi - lo].tolist()))
    return assemble(samples, [pieces]), flex


@pytest.mark.parametrize("arch", ["vl", "q2"])
def test_flex_ulysses_lm_on_one_rank_equals_hf(tiny_assets, arch):
    model = load_model(tiny_assets[arch])
    data = tiny_assets["data"]
    if arch == "q2":  # the text model scores the same records without media
        from flexrl_ds.models.sample_data import text_only_copy

        data = str(text_only_copy(data))
    samples = encode_dataset(tiny_assets[arch], data)
    with torch.no_grad():
        expected = {s: reference_logprobs(model, x) for s, x in samples.items()}
    plan = random_plan_for({s: x.length for s, x in samples.items()}, 1, 1, seed=0)
    got, flex = _one_rank_logprobs(model, samples, plan)
    for seq_id in samples:
        torch.testing.assert_close(torch.tensor(got[seq_id]), expected[seq_id], atol=2e-5, rtol=1e-5)
    config = model.config
    assert hf_adapter.text_config(model)._attn_implementation == hf_adapter.ATTENTION_NAME
    if arch == "vl":
        assert config.vision_config._attn_implementation == hf_adapter.VISION_ATTENTION_NAME
    assert flex.attention.last_paths == ["local"] * len(plan.packs)


def test_attention_without_step_kwarg_is_an_error(vl_samples):
    model, samples = vl_samples
    hf_adapter.register()
    query = torch.zeros(1, 6, 3, 8)
    with pytest.raises(ValueError, match=hf_adapter.STEP_KWARG):
        hf_adapter.flex_ulysses_attention(None, query, query[:, :2], query[:, :2], None)
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    assert ALL_MASK_ATTENTION_FUNCTIONS[hf_adapter.ATTENTION_NAME]() is None


def test_idle_rank_runs_every_module_once_and_contributes_zero(tiny_assets):
    """A rank without tokens (text model, no collectives needed) still gives every parameter a
    gradient (ZeRO-3 reduces all of them on every rank), all zeros."""
    from flexrl_ds.models.sample_data import text_only_copy
    from flexrl_ds.planning.plan import Pack, Plan

    model = load_model(tiny_assets["q2"])
    samples = encode_dataset(tiny_assets["q2"], str(text_only_copy(tiny_assets["data"], "idle_text.jsonl")))
    plan = Plan(world_size=2, p_max=2, packs=(Pack(0, 1, (0,), tuple(samples)),), rank_order={0: (0,), 1: ()})
    batch = build_step_batch(model.config, plan, samples, rank=1)
    assert batch.layout.num_local_tokens == 0
    flex = FlexUlyssesLM(model)
    logprobs, entropy, zero = flex(batch)
    assert logprobs.numel() == 0 and entropy is None and float(zero.detach()) == 0.0
    zero.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert not param.grad.any(), name


def _reference_with_entropy(model, sample):
    """Plain HF: response-token log-probs and next-token entropies from the full fp32 logits."""
    logits = model(**reference_inputs(model, sample)).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    target = logprobs.gather(1, sample.input_ids[1:].unsqueeze(1)).squeeze(1)
    entropy = -(logprobs.exp() * logprobs).sum(-1)
    start = sample.response_start - 1
    return target[start:], entropy[start:]


def test_logprobs_at_a_sampling_temperature_are_those_of_hf_logits_over_it(tiny_assets):
    """The trainer scores responses under the distribution the rollout sampled from: a plain HF
    forward's logits divided by the temperature; a temperature that is not positive is refused."""
    model = load_model(tiny_assets["vl"])
    samples = encode_dataset(tiny_assets["vl"], tiny_assets["data"])
    temperature = 0.6
    expected = {}
    with torch.no_grad():
        for seq_id, sample in samples.items():
            logits = model(**reference_inputs(model, sample)).logits[0].float() / temperature
            targets = sample.input_ids[1:].unsqueeze(1)
            expected[seq_id] = torch.log_softmax(logits[:-1], dim=-1).gather(1, targets)[:, 0][sample.response_start - 1:]
            torch.testing.assert_close(reference_logprobs(model, sample, temperature), expected[seq_id])
    plan = random_plan_for({s: x.length for s, x in samples.items()}, 1, 1, seed=0)
    got, _ = _one_rank_logprobs(model, samples, plan, temperature)
    at_one, _ = _one_rank_logprobs(model, samples, plan)
    for seq_id in samples:
        torch.testing.assert_close(torch.tensor(got[seq_id]), expected[seq_id], atol=2e-5, rtol=1e-5)
        assert not torch.allclose(torch.tensor(got[seq_id]), torch.tensor(at_one[seq_id]))
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature: must be > 0"):
            FlexUlyssesLM(model, temperature=bad)


def test_chunked_logprobs_and_entropy_with_grad_equal_hf(tiny_assets):
    """With grad: lm_head in checkpointed chunks of 5 tokens; values and every parameter's gradient
    of a weighted sum of log-probs and entropies equal the full-logits HF computation."""
    samples = encode_dataset(tiny_assets["vl"], tiny_assets["data"])
    reference_model, model = load_model(tiny_assets["vl"]), load_model(tiny_assets["vl"])
    weights = {s: torch.randn(x.length - x.response_start, 2, generator=torch.Generator().manual_seed(i))
               for i, (s, x) in enumerate(samples.items())}
    total = 0.0
    expected = {}
    for seq_id, sample in samples.items():
        logprobs, entropy = _reference_with_entropy(reference_model, sample)
        expected[seq_id] = (logprobs.detach(), entropy.detach())
        total = total + (logprobs * weights[seq_id][:, 0]).sum() + (entropy * weights[seq_id][:, 1]).sum()
    total.backward()
    plan = random_plan_for({s: x.length for s, x in samples.items()}, 1, 1, seed=0)
    batch = build_step_batch(model.config, plan, samples, 0, positions=positions_fn(model))
    logprobs, entropy, zero = FlexUlyssesLM(model, logits_chunk=5)(batch, with_entropy=True)
    mask = batch.response_mask
    local_w = batch.layout.slice_tokens({s: torch.cat([torch.zeros(x.response_start - 1, 2), weights[s],
                                                         torch.zeros(1, 2)]) for s, x in samples.items()}, dim=0)
    for seq_id, lo, hi, local in batch.layout.segments():
        start = samples[seq_id].response_start - 1
        piece = slice(local + start - lo, local + hi - 1 - lo)
        torch.testing.assert_close(logprobs[piece].detach(), expected[seq_id][0], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(entropy[piece].detach(), expected[seq_id][1], atol=2e-5, rtol=1e-5)
    loss = (torch.where(mask, logprobs * local_w[:, 0] + entropy * local_w[:, 1], 0.0)).sum() + zero
    loss.backward()
    reference_grads = dict(reference_model.named_parameters())
    for name, param in model.named_parameters():
        expected_grad = reference_grads[name].grad
        assert (param.grad is None) == (expected_grad is None), name
        if expected_grad is not None:
            torch.testing.assert_close(param.grad, expected_grad, atol=1e-5, rtol=1e-4, msg=name)


def test_entropy_as_a_statistic_has_no_graph_and_leaves_the_logprob_gradients(tiny_assets):
    """entropy_grad=False: the same entropies, no graph through them, and the log-probs' gradients
    equal those of the differentiable entropy's forward (the entropy's zero term adds nothing)."""
    samples = encode_dataset(tiny_assets["vl"], tiny_assets["data"])
    plan = random_plan_for({s: x.length for s, x in samples.items()}, 1, 1, seed=0)
    grads, entropies = [], []
    for entropy_grad in (True, False):
        model = load_model(tiny_assets["vl"])
        batch = build_step_batch(model.config, plan, samples, 0, positions=positions_fn(model))
        logprobs, entropy, zero = FlexUlyssesLM(model, logits_chunk=5)(batch, with_entropy=True,
                                                                       entropy_grad=entropy_grad)
        assert entropy.requires_grad == entropy_grad
        (torch.where(batch.response_mask, logprobs, 0.0).sum() + zero).backward()
        grads.append({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
        entropies.append(entropy.detach())
    torch.testing.assert_close(entropies[0], entropies[1], atol=0, rtol=0)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5, msg=name)
