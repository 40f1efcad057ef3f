"""`flexrl bench sp --calibrate OUT.json`: measure the cost model's constants on this machine.

Writes the calibration file format of flexrl_ds/planning/cost_model.py:
- `attention_fit_s` / `linear_fit_s` / `num_layers`: the per-layer fits kept whole (non-negative
  least squares): attention fwd+bwd of one pack t = a·L² + b·L + c (c the per-pack floor), linear
  t = s·L + c; the step-time model (planning/step_time.py) uses all of them. Add `model_shapes`
  (hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim) to let `calibration: auto`
  pick the file for that model;
- `attention_s_per_token2`: a × layers (older readers);
- `linear_s_per_token`: the layer's projections + gated MLP forward+backward on L tokens, fit
  t = s·L + c, s × layers;
- `all_to_all`: per group size d of the tree (2..p_max): latency (small message) and bytes/s
  (large message) of one `all_to_all_single`;
- `bytes_per_token`: bytes one token carries through one all-to-all of q (heads × head_dim × dtype).
Every rank measures; rank 0 writes the file (compute numbers are rank 0's).
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Sequence

from flexrl_ds.parallel import device as device_mod
from flexrl_ds.sp.local_attention import CausalVarlenAttention

LAYERS = {"7b": 28}
"""Decoder layers the per-layer numbers are scaled to (Qwen2.5-VL-7B's LLM); other shapes: 1."""
ATTENTION_LENGTHS = (2048, 4096, 8192, 16384)
LINEAR_LENGTHS = (2048, 4096, 8192, 16384)


def _timed(fn: Callable[[], None], ctx, repeats: int = 3) -> float:
    """Median seconds of `fn` after one warm-up (device synchronised around each call)."""
    fn()
    times = []
    for _ in range(repeats):
        device_mod.synchronize(ctx.info)
        start = time.perf_counter()
        fn()
        device_mod.synchronize(ctx.info)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _fit(xs: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Non-negative least squares over the columns of `xs` (every subset of terms tried; a term
    whose unconstrained coefficient is negative is a fit artefact, not a negative cost)."""
    import itertools

    import numpy as np

    cols, y = np.array(xs, dtype=float), np.array(ys, dtype=float)
    best = None
    for k in range(1, cols.shape[1] + 1):
        for subset in itertools.combinations(range(cols.shape[1]), k):
            coef, *_ = np.linalg.lstsq(cols[:, subset], y, rcond=None)
            residual = float(((cols[:, subset] @ coef - y) ** 2).sum())
            if (coef >= 0).all() and (best is None or residual < best[0]):
                full = np.zeros(cols.shape[1])
                full[list(subset)] = coef
                best = (residual, full)
    return [float(c) for c in best[1]] if best is not None else [0.0] * cols.shape[1]


def measure_attention(layer, ctx, dtype, lengths: Sequence[int]) -> dict[str, Any]:
    import torch

    local = CausalVarlenAttention()
    points = []
    for length in lengths:
        q = torch.randn(length, layer.heads, layer.head_dim, device=ctx.device, dtype=dtype, requires_grad=True)
        k = torch.randn(length, layer.kv_heads, layer.head_dim, device=ctx.device, dtype=dtype, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)

        def step():
            local(q, k, v, [0, length], length, None).float().sum().backward()

        points.append((length, _timed(step, ctx)))
    a, b, c = _fit([[n * n, n, 1] for n, _ in points], [t for _, t in points])
    return {"points": points, "a": max(a, 1e-30), "b": b, "c": c}


def measure_linear(layer, ctx, dtype, lengths: Sequence[int]) -> dict[str, Any]:
    import torch

    def identity_attention(q, k, v, layout):
        return q  # the layer's linear work without attention

    points = []
    for length in lengths:
        x = torch.randn(length, layer.wo.shape[0], device=ctx.device, dtype=dtype)

        def step():
            x_in = x.detach().requires_grad_(True)
            layer(x_in, identity_attention, None).float().sum().backward()

        points.append((length, _timed(step, ctx)))
    s, c = _fit([[n, 1] for n, _ in points], [t for _, t in points])
    return {"points": points, "s": max(s, 1e-30), "c": c}


def measure_all_to_all(tree, ctx, dtype, sizes_mb: Sequence[float] = (0.004, 512.0)) -> dict[str, dict[str, float]]:
    """Latency (smallest size) and bandwidth (largest) per group size; this rank's groups only.

    The large message must dwarf the latency (on 2 H200s a 64 MiB message took ~1.3x the 4 KiB
    latency, which made the first recorded bandwidth meaningless), hence 512 MiB.
    """
    import torch
    import torch.distributed as dist

    out = {}
    element = torch.empty((), dtype=dtype).element_size()
    for degree in tree.topology.degrees():
        first = tree.local_rank // degree * degree
        group = tree.group_for(degree, first)
        times = []
        for size_mb in sizes_mb:
            numel = max(degree, int(size_mb * 2**20 / element) // degree * degree)
            send = torch.randn(numel, device=ctx.device).to(dtype)
            recv = torch.empty_like(send)

            def step():
                dist.all_to_all_single(recv, send, group=group)

            times.append((numel * element, _timed(step, ctx, repeats=5)))
        (_, t_small), (big_bytes, t_big) = times[0], times[-1]
        # Bytes leaving each rank: (d-1)/d of its buffer.
        moved = big_bytes * (degree - 1) / degree
        out[str(degree)] = {"latency_s": t_small, "bytes_per_s": moved / t_big, "source": "measured"}
    return out


def calibrate_rank(config, tree, layer, ctx) -> dict[str, Any]:
    """Measure on every rank (the all-to-alls need all); return the calibration record."""
    dtype = layer.wo.dtype
    num_layers = LAYERS.get(config.shape, 1)
    lengths = [n for n in ATTENTION_LENGTHS if n <= max(config.long_tokens)] or [256, 512, 1024]
    attention = measure_attention(layer, ctx, dtype, lengths)
    linear = measure_linear(layer, ctx, dtype, [n for n in LINEAR_LENGTHS if n <= max(lengths)] or lengths)
    all_to_all = measure_all_to_all(tree, ctx, dtype)
    bytes_per_token = layer.heads * layer.head_dim * torch_element_size(dtype)
    return {
        "attention_fit_s": {"a": attention["a"], "b": attention["b"], "c": attention["c"]},
        "linear_fit_s": {"s": linear["s"], "c": linear["c"]},
        "num_layers": num_layers,
        "device_name": device_mod.accelerator_name(),
        "bytes_per_element": torch_element_size(dtype),
        "attention_s_per_token2": attention["a"] * num_layers,
        "linear_s_per_token": linear["s"] * num_layers,
        "all_to_all": all_to_all,
        "bytes_per_token": bytes_per_token,
        "measured": {"layers_scaled_to": num_layers, "attention_points_s": attention["points"],
                     "linear_points_s": linear["points"], "device": ctx.info.kind,
                     "world_size": tree.topology.world_size, "dtype": str(dtype)},
    }


def torch_element_size(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, indent=1)
