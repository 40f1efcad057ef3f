"""A family's host-computed tower inputs (`ModelFamily.vision_call_inputs`) give the tower call the
same output and gradients as the tower computing them itself, and the tower uses them (a changed
input changes the output): Qwen2.5-VL (windows, full-attention blocks), Qwen2-VL (no windows),
Qwen3-VL and its MoE (interpolated position table), with the trainer's varlen attention and with
transformers' sdpa. The trainer's path through `encode_and_route` is covered by the FlexModel tests
against plain HF (tests/unit/models/test_flex_model.py, tests/distributed/)."""

from __future__ import annotations

import copy

import pytest
import torch

from flexrl_ds.families import family_of
from flexrl_ds.models import hf_adapter

# odd windows (partial at the edges), a two-frame video, a tall narrow image; Qwen3's grids are
# (t, h, w) in 16-px patches, Qwen2.5's in 14-px ones: both need h and w even (merge 2)
GRIDS = [[1, 6, 10], [2, 4, 4], [1, 14, 2]]


ARCHES = ("qwen2.5-vl", "qwen2-vl", "qwen3-vl", "qwen3-vl-moe")


def tiny_qwen2_vl():
    """A tiny random Qwen2-VL (make-tiny-model has no such arch; only its tower is used here)."""
    import transformers

    config = transformers.Qwen2VLConfig(
        text_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64, vocab_size=160, bos_token_id=None, eos_token_id=None,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3))
    torch.manual_seed(5)
    return transformers.Qwen2VLForConditionalGeneration(config)


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("towers")
    models = {arch: load_model(make_tiny_model(TinyModelConfig(out_dir=str(root / arch), arch=arch, seed=5)))
              for arch in ARCHES if arch != "qwen2-vl"}
    return {**models, "qwen2-vl": tiny_qwen2_vl()}


def _call(family, visual, pixels, grids, inputs):
    pixels = pixels.clone().requires_grad_(True)
    merged, extra = family.encode_vision(visual, pixels, grids, inputs)
    out = merged if extra is None else torch.cat([merged, extra], dim=-1)
    visual.zero_grad(set_to_none=True)
    out.square().sum().backward()
    grads = {name: p.grad.clone() for name, p in visual.named_parameters() if p.grad is not None}
    return out.detach(), pixels.grad, grads


def _tower(model, attention: str):
    model = copy.deepcopy(model)
    hf_adapter.use_flex_ulysses(model, attention)
    family = family_of(model.config)
    return family, family.vision_tower(model)


def _pixels(visual, grids):
    config = visual.config
    patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
    return torch.randn(int(grids.prod(dim=1).sum()), patch_dim, generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("attention", ["varlen", "sdpa"])
@pytest.mark.parametrize("arch", ARCHES)
def test_host_inputs_give_the_towers_own_output_and_gradients(towers, arch, attention):
    family, visual = _tower(towers[arch], attention)
    grids = torch.tensor(GRIDS)
    pixels = _pixels(visual, grids)
    inputs = family.vision_call_inputs(visual, grids)
    assert inputs and all(value.device.type == "cpu" for value in inputs.values() if isinstance(value, torch.Tensor))
    expected = _call(family, visual, pixels, grids, None)
    got = _call(family, visual, pixels, grids, inputs)
    torch.testing.assert_close(got[0], expected[0])
    torch.testing.assert_close(got[1], expected[1])
    assert got[2].keys() == expected[2].keys()
    for name in expected[2]:
        torch.testing.assert_close(got[2][name], expected[2][name], msg=name)


@pytest.mark.parametrize("arch, key", [("qwen2.5-vl", "position_ids"), ("qwen2.5-vl", "window_index"),
                                       ("qwen2-vl", "position_ids"), ("qwen3-vl", "position_ids"),
                                       ("qwen3-vl", "interp_weights"), ("qwen3-vl-moe", "interp_weights")])
def test_the_tower_uses_the_given_inputs(towers, arch, key):
    """A key transformers stopped reading would pass unused into the blocks' keywords: the output
    would not move."""
    family, visual = _tower(towers[arch], "varlen")
    grids = torch.tensor(GRIDS)
    pixels = _pixels(visual, grids)
    inputs = family.vision_call_inputs(visual, grids)
    changed = dict(inputs)
    changed[key] = inputs[key].flip(0)
    with torch.no_grad():
        same = family.encode_vision(visual, pixels, grids, dict(inputs))[0]
        moved = family.encode_vision(visual, pixels, grids, changed)[0]
    assert not torch.allclose(same, moved)


@pytest.mark.parametrize("arch", ARCHES)
def test_longest_bounds_are_given_under_the_varlen_attention_only(towers, arch):
    """The GPU varlen kernels read the maxima (the CPU fallback does not): each is its bounds' longest
    span under the trainer's attention; under sdpa the tower takes none, as it computes none."""
    grids = torch.tensor(GRIDS)
    family, visual = _tower(towers[arch], "varlen")
    inputs = family.vision_call_inputs(visual, grids)
    pairs = [("cu_seqlens", "max_seqlen")] + ([("cu_window_seqlens", "max_window_seqlen")]
                                              if "window_index" in inputs else [])
    for bounds, longest in pairs:
        assert inputs[longest] == int(inputs[bounds].diff().max()), (bounds, longest)
    frames = [h * w for t, h, w in GRIDS for _ in range(t)]
    assert inputs["cu_seqlens"].tolist() == [0] + list(torch.tensor(frames).cumsum(0).tolist())
    family, visual = _tower(towers[arch], "sdpa")
    assert not {"max_seqlen", "max_window_seqlen"} & family.vision_call_inputs(visual, grids).keys()
