"""A family's host-computed tower inputs (`ModelFamily.vision_call_inputs`) give the tower call the
same output and gradients as the tower computing them itself, and the tower uses them (a changed
input changes the output): Qwen2.5-VL (windows, full-attention blocks) and Qwen3-VL (interpolated
position table), with the trainer's varlen attention and with transformers' sdpa."""

from __future__ import annotations

import copy

import pytest
import torch

from flexrl_ds.families import family_of
from flexrl_ds.models import hf_adapter

# odd windows (partial at the edges), a two-frame video, a tall narrow image; Qwen3's grids are
# (t, h, w) in 16-px patches, Qwen2.5's in 14-px ones: both need h and w even (merge 2)
GRIDS = [[1, 6, 10], [2, 4, 4], [1, 14, 2]]


@pytest.fixture(scope="module")
def towers(tmp_path_factory):
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("towers")
    return {arch: load_model(make_tiny_model(TinyModelConfig(out_dir=str(root / arch), arch=arch, seed=5)))
            for arch in ("qwen2.5-vl", "qwen3-vl")}


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
@pytest.mark.parametrize("arch", ["qwen2.5-vl", "qwen3-vl"])
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
                                       ("qwen3-vl", "position_ids"), ("qwen3-vl", "interp_weights")])
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
