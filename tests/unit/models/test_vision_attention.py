"""The vision tower's varlen attention (models/hf_adapter.py "flexrl_flash_varlen") equals
transformers' own per-window SDPA, in one attention call per layer."""

from __future__ import annotations

import copy

import pytest
import torch

from flexrl_ds.models import hf_adapter
from flexrl_ds.sp.local_attention import sdpa_varlen


def dense_block_attention(q, k, v, bounds, scaling):
    """Independent reference: one dense softmax over all tokens, a mask keeping each token inside
    its own [bounds[i], bounds[i+1])."""
    segment = torch.zeros(q.shape[0], dtype=torch.long)
    for index, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        segment[lo:hi] = index
    allowed = segment[:, None] == segment[None, :]
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scaling
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


@pytest.mark.parametrize("bounds", [[0, 5], [0, 3, 3, 11, 12], [0, 16, 20, 36]])
def test_bidirectional_varlen_equals_a_masked_dense_softmax(bounds):
    generator = torch.Generator().manual_seed(len(bounds))
    q = torch.randn(bounds[-1], 4, 8, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(bounds[-1], 2, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    expected = dense_block_attention(q, k, v, bounds, 0.3)
    for given in (bounds, torch.tensor(bounds, dtype=torch.int32)):  # a list, or a tensor as transformers passes
        torch.testing.assert_close(sdpa_varlen(q, k, v, given, 16, 0.3, causal=False), expected)


def _tower_outputs(visual, pixels, grids):
    pixels = pixels.clone().requires_grad_(True)
    out = visual(pixels, grid_thw=grids).pooler_output
    out.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in visual.named_parameters()}
    return out.detach(), pixels.grad, grads


def test_vision_tower_on_varlen_equals_transformers_sdpa_in_one_call_per_layer(vl_samples, monkeypatch):
    model, _ = vl_samples
    reference = copy.deepcopy(model)
    hf_adapter.use_flex_ulysses(reference, "sdpa")
    varlen = copy.deepcopy(model)
    hf_adapter.use_flex_ulysses(varlen)
    assert varlen.config.vision_config._attn_implementation == hf_adapter.VISION_ATTENTION_NAME
    assert varlen.model.visual.config is varlen.config.vision_config  # the tower reads the config set
    config = model.config.vision_config
    grids = torch.tensor([[1, 6, 10], [2, 4, 4], [1, 14, 2]])  # odd windows: partial at the edges
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    pixels = torch.randn(int(grids.prod(dim=1).sum()), patch_dim, generator=torch.Generator().manual_seed(3))
    calls = []
    picked = hf_adapter.pick_backend
    monkeypatch.setattr(hf_adapter, "pick_backend", lambda *a: calls.append(a) or picked(*a))
    got = _tower_outputs(varlen.model.visual, pixels, grids)
    assert len(calls) == config.depth  # one call per layer, whatever the number of windows
    expected = _tower_outputs(reference.model.visual, pixels, grids)
    torch.testing.assert_close(got[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], expected[1], atol=1e-5, rtol=1e-5)
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_vision_attention_refuses_calls_without_sequence_bounds_and_unknown_choices(vl_samples):
    query = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        hf_adapter.varlen_vision_attention(None, query, query, query, None)
    with pytest.raises(ValueError, match="'varlen' or 'sdpa'"):
        hf_adapter.use_flex_ulysses(copy.deepcopy(vl_samples[0]), "flash")


@pytest.mark.parametrize("choice, name", [("varlen", hf_adapter.VISION_ATTENTION_NAME), ("sdpa", "sdpa")])
def test_flex_model_puts_its_vision_tower_on_the_chosen_attention(vl_samples, choice, name):
    from flexrl_ds.models.flex_model import FlexUlyssesLM

    flex = FlexUlyssesLM(copy.deepcopy(vl_samples[0]), vision_attention=choice)
    assert flex.hf_model.model.visual.config._attn_implementation == name
