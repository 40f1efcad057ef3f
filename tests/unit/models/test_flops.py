"""Model FLOPs of the trainer's passes (models/flops.py) against torch's FLOP counter on a tiny
decoder, and the MFU the driver logs from them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from flexrl_ds.models.flops import DecoderShape, peak_bf16_flops, training_forward_flops
from flexrl_ds.trainer.step_figures import step_mfu, vision_forward_flops


@pytest.fixture
def model(tiny_decoder):
    return tiny_decoder


def shape_of(model) -> DecoderShape:
    return DecoderShape.from_config(model.config)


@pytest.mark.parametrize("length", [1, 9, 40])
def test_forward_flops_are_the_counted_ones_less_the_masked_half_of_attention(model, length):
    """An eager forward computes every query-key pair (the mask zeroes the later keys afterwards);
    the model FLOPs count the causal pairs only, and logits at every position."""
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(torch.arange(length)[None])
    shape = shape_of(model)
    masked = shape.attention_flops_per_key() * (length * length - length * (length + 1) // 2)
    assert counter.get_total_flops() == training_forward_flops(shape, length) + masked


def test_backward_is_twice_the_forward_for_the_matmuls(model):
    """What `mfu` charges an update: 3 × the forward (a backward computes the input's and the
    weights' gradients of every matmul), here on the linear layers alone."""
    layer = torch.nn.Linear(64, 96, bias=False)
    x = torch.randn(5, 64, requires_grad=True)
    counter = FlopCounterMode(display=False)
    with counter:
        layer(x).sum().backward()
    assert counter.get_total_flops() == 3 * 2 * 5 * 64 * 96


@pytest.mark.parametrize("name, peak", [("NVIDIA H200", 989.4e12), ("NVIDIA H100 80GB HBM3", 989.4e12),
                                        ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200 NVL", 835e12),
                                        ("NVIDIA A100-SXM4-80GB", 312e12),
                                        ("NVIDIA H20", 148e12), ("NVIDIA GeForce RTX 3090", None), (None, None)])
def test_peak_by_gpu_name(name, peak):
    assert peak_bf16_flops(name) == peak


def test_mfu_charges_every_sample_by_prompt_plus_response(model):
    shape = shape_of(model)
    prompts = [SimpleNamespace(prompt_ids=[1] * 30, sample_names=["a0", "a1"]),
               SimpleNamespace(prompt_ids=[1] * 7, sample_names=["b0", "b1"])]
    samples = SimpleNamespace(names=["a0", "a1", "b0", "b1"],
                              prompt_of=lambda: {n: p for p in prompts for n in p.sample_names})
    lengths = [5, 0, 12, 3]  # response tokens
    options = SimpleNamespace(decoder=shape, peak_flops=1e9, num_ranks=4)  # only what `step_mfu` uses
    times = {"update": 2.0, "inference": 0.5}
    forward = sum(training_forward_flops(shape, n) for n in (35, 30, 19, 10))
    mfu = step_mfu(options, samples, lengths, times, passes=2)["mfu"]
    assert mfu["update"] == pytest.approx(3 * forward / (4 * 1e9 * 2.0))
    assert mfu["inference"] == pytest.approx(2 * forward / (4 * 1e9 * 0.5))
    with_vision = step_mfu(options, samples, lengths, times, passes=2, vision_forward=7e6)["mfu"]
    assert with_vision["update"] == pytest.approx(3 * (forward + 7e6) / (4 * 1e9 * 2.0))
    assert with_vision["inference"] == pytest.approx(2 * (forward + 7e6) / (4 * 1e9 * 0.5))
    options.peak_flops = None  # CPU or an unknown GPU: no MFU
    assert step_mfu(options, samples, lengths, times, passes=2) == {}


@pytest.mark.parametrize("grid", [(6, 10), (8, 8), (14, 2), (18, 34)])
def test_vision_unit_flops_are_what_torch_counts_on_the_tower(vl_samples, grid):
    """The tiny Qwen2.5-VL tower under transformers' eager attention (per window, as matmuls torch's
    counter sees): every matmul, the patch embedding's convolution and the windows' (and the full
    blocks' whole-unit) attention."""
    import copy

    from flexrl_ds.models.flops import VisionShape, vision_unit_flops

    model = copy.deepcopy(vl_samples[0])
    model.set_attn_implementation({"text_config": "eager", "vision_config": "eager"})
    config = model.config.vision_config
    shape = VisionShape.from_config(config)
    assert shape.window_merged > 1 and shape.full_attention_blocks >= 1  # both kinds of block counted
    pixels = torch.randn(grid[0] * grid[1], shape.patch_dim)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model.model.visual(pixels, grid_thw=torch.tensor([[1, *grid]]))
    assert counter.get_total_flops() == vision_unit_flops(shape, *grid)


def test_mfu_counts_each_encoded_vision_unit_once_per_domain_and_micro_batch(vl_samples):
    """What the ranks encode (models/vision_balance.py): a prompt's shared items once per SP domain and
    micro-batch, an item without a share key once per sequence, a video once per temporal group."""
    from flexrl_ds.models.flops import VisionShape, vision_unit_flops

    shape = VisionShape.from_config(vl_samples[0].config.vision_config)
    item = lambda key, t, h, w: SimpleNamespace(share_key=key, grid_thw=(t, h, w))  # noqa: E731
    encoded = {"a0": SimpleNamespace(items=[item("a/0", 2, 4, 6), item("a/1", 1, 8, 8)]),
               "a1": SimpleNamespace(items=[item("a/0", 2, 4, 6), item("a/1", 1, 8, 8)]),
               "b0": SimpleNamespace(items=[item(None, 1, 6, 10)]),
               "b1": SimpleNamespace(items=[item(None, 1, 6, 10)])}

    def result(*names):
        return SimpleNamespace(plan=SimpleNamespace(packs=[SimpleNamespace(sequences=(name,)) for name in names]))

    unit = lambda h, w: vision_unit_flops(shape, h, w)  # noqa: E731
    prompt_a, prompt_b = 2 * unit(4, 6) + unit(8, 8), unit(6, 10)
    one_domain = [[result("a0", "a1", "b0", "b1")]]
    assert vision_forward_flops(shape, one_domain, encoded) == pytest.approx(prompt_a + 2 * prompt_b)
    split = [[result("a0", "b0"), result("a1", "b1")]]  # two domains: each encodes prompt a
    assert vision_forward_flops(shape, split, encoded) == pytest.approx(2 * prompt_a + 2 * prompt_b)
    cut = [[result("a0")], [result("a1", "b0", "b1")]]  # two micro-batches: a again in the second
    assert vision_forward_flops(shape, cut, encoded) == pytest.approx(2 * prompt_a + 2 * prompt_b)
    assert vision_forward_flops(None, one_domain, encoded) == 0.0  # a text model
