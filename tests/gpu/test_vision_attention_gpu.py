"""The vision tower's varlen attention on one GPU (bf16, torch's varlen kernel or flash-attn):
- the kernel, bidirectional within each window, against a float64 dense softmax with a block mask;
- a Qwen2.5-VL-shaped vision tower (the 3B's widths, 4 layers) under "varlen" against transformers'
  per-window SDPA ("sdpa"): outputs and gradients, and how long each takes for a step's worth of
  frames (printed; figures on docs/BENCHMARKS.md, "Update efficiency (`flexrl bench update`)").
Run there: source tests/gpu/gpu_env.sh; python3 -m pytest -q -s tests/gpu/test_vision_attention_gpu.py"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit" / "models"))

from test_vision_attention import dense_block_attention  # noqa: E402


def test_bidirectional_varlen_kernel_matches_a_float64_dense_softmax():
    from flexrl_ds.sp.local_attention import pick_backend

    bounds = [0, 64, 100, 164, 180, 244]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(bounds[-1], 16, 80, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(bounds[-1], 16, 80, generator=generator, dtype=torch.float64) for _ in range(2))
    expected = dense_block_attention(q, k, v, bounds, 80 ** -0.5)
    inputs = [t.to("cuda", torch.bfloat16).requires_grad_(True) for t in (q, k, v)]
    kernel = pick_backend("auto", inputs[0])
    assert kernel.__name__ != "sdpa_varlen", "no varlen kernel on this GPU"
    got = kernel(*inputs, torch.tensor(bounds, device="cuda"), 64, 80 ** -0.5, causal=False)
    torch.testing.assert_close(got.double().cpu(), expected, atol=2e-2, rtol=2e-2)
    reference = [t.clone().requires_grad_(True) for t in (q, k, v)]
    dense_block_attention(*reference, bounds, 80 ** -0.5).sum().backward()
    got.float().sum().backward()
    for mine, theirs in zip(inputs, reference):
        torch.testing.assert_close(mine.grad.double().cpu(), theirs.grad, atol=5e-2, rtol=5e-2)


def _tower(tmp_path):
    import transformers

    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    folder = make_tiny_model(TinyModelConfig(out_dir=str(tmp_path / "m"), vision_hidden_size=1280, vision_num_heads=16,
                                             vision_depth=4), weights=False)
    config = transformers.AutoConfig.from_pretrained(str(folder))
    config.vision_config.intermediate_size, config.vision_config.window_size = 3420, 112  # Qwen2.5-VL's
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    return model


def _run(model, pixels, grids, repeats: int):
    visual = model.model.visual
    times = []
    for _ in range(repeats):
        visual.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = visual(pixels, grid_thw=grids).pooler_output
        out.float().square().mean().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    grads = {name: p.grad.float() for name, p in visual.named_parameters()}
    return out.float(), grads, min(times)


def test_vision_tower_on_varlen_matches_sdpa_and_is_timed(tmp_path):
    from flexrl_ds.models import hf_adapter

    model = _tower(tmp_path)
    sdpa, varlen = copy.deepcopy(model), model
    hf_adapter.use_flex_ulysses(sdpa, "sdpa")
    hf_adapter.use_flex_ulysses(varlen)
    # a step's worth of frame groups like the GPU runner's data: 64 units of 20 x 28 patches, and odd ones
    grids = torch.tensor([[1, 20, 28]] * 64 + [[1, 6, 10], [1, 14, 2], [1, 34, 18]], device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(1)
    pixels = torch.randn(int(grids.prod(dim=1).sum()), 1176, device="cuda", generator=generator).to(torch.bfloat16)
    out_v, grads_v, seconds_v = _run(varlen, pixels, grids, repeats=3)
    out_s, grads_s, seconds_s = _run(sdpa, pixels, grids, repeats=3)
    print(f"\nvision tower forward+backward, {pixels.shape[0]} patches, 4 layers of 1280: "
          f"varlen {seconds_v * 1e3:.1f} ms, sdpa per window {seconds_s * 1e3:.1f} ms")
    scale = out_s.abs().mean()
    assert (out_v - out_s).abs().mean() < 2e-2 * scale
    for name, grad in grads_s.items():
        assert (grads_v[name] - grad).abs().mean() <= 5e-2 * grad.abs().mean() + 1e-6, name
