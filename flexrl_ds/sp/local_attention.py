"""Attention over the packed sequences of one pack, on one rank (no communication).

`CausalVarlenAttention()(q, k, v, cu_seqlens, max_seqlen, scaling)`: q (T, Hq, D), k/v (T, Hk, D)
with Hq a multiple of Hk (query head i uses KV head i // (Hq/Hk)); each sequence [cu[i], cu[i+1])
attends causally to itself only. The backend functions also take `causal=False` (each sequence
attends to all of itself: the vision tower's windows, models/hf_adapter.py) and `cu_seqlens` as a
list or a device tensor. Backends, same results:
- `flash`: flash-attn varlen (if installed; GPU, fp16/bf16),
- `torch_varlen`: torch.nn.attention.varlen.varlen_attn (if present; GPU, fp16/bf16),
- `sdpa`: scaled_dot_product_attention per sequence (everywhere, any dtype; one call per sequence).
`auto` picks the first that fits the tensors.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from flexrl_ds.parallel.device import constant_on
from flexrl_ds.sp import flash_attention_backend

BACKENDS = ("auto", "flash", "torch_varlen", "sdpa")
_HALF = (torch.float16, torch.bfloat16)


def sdpa_varlen(q, k, v, cu_seqlens, max_seqlen: int, scaling: float | None, causal: bool = True):
    """Reference backend: SDPA on each sequence (GQA by repeating KV heads)."""
    bounds = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    repeat = q.shape[1] // k.shape[1]
    outs = []
    for start, end in zip(bounds, bounds[1:]):
        q_s = q[start:end].transpose(0, 1).unsqueeze(0)
        k_s = k[start:end].transpose(0, 1).unsqueeze(0)
        v_s = v[start:end].transpose(0, 1).unsqueeze(0)
        if repeat > 1:
            k_s, v_s = k_s.repeat_interleave(repeat, dim=1), v_s.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=causal, scale=scaling)
        outs.append(out.squeeze(0).transpose(0, 1))
    if not outs:
        return q.new_empty(q.shape)
    return torch.cat(outs)


@functools.lru_cache(maxsize=1)
def _torch_varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    return varlen_attn


@functools.lru_cache(maxsize=1)
def _torch_varlen_params() -> frozenset[str]:
    """The keyword names of torch's varlen_attn (they differ across torch releases), read once."""
    return frozenset(inspect.signature(_torch_varlen_fn()).parameters)


def _bounds_tensor(cu_seqlens, device) -> torch.Tensor:
    if isinstance(cu_seqlens, torch.Tensor):
        return cu_seqlens.to(device=device, dtype=torch.int32)
    return constant_on(tuple(int(b) for b in cu_seqlens), torch.int32, torch.device(device))  # made once a pack


def torch_varlen(q, k, v, cu_seqlens, max_seqlen: int, scaling: float | None, causal: bool = True):
    """torch's varlen kernel (causal spelled per torch release: is_causal or window (-1, 0))."""
    varlen_attn = _torch_varlen_fn()
    cu = _bounds_tensor(cu_seqlens, q.device)
    params = _torch_varlen_params()
    kwargs: dict[str, Any] = {"scale": scaling}
    kwargs.update({"is_causal": causal} if "is_causal" in params else {"window_size": (-1, 0 if causal else -1)})
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return varlen_attn(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), **kwargs)


def flash_varlen(q, k, v, cu_seqlens, max_seqlen: int, scaling: float | None, causal: bool = True):
    cu = _bounds_tensor(cu_seqlens, q.device)
    return flash_attention_backend.flash_varlen(q, k, v, cu, int(max_seqlen), scaling, causal)


def pick_backend(name: str, q) -> Callable:
    """The attention function for backend `name` (see module doc) and tensors like `q`."""
    if name not in BACKENDS:
        raise ValueError(f"local attention: unknown backend {name!r}; one of {', '.join(BACKENDS)}")
    fast_ok = q.device.type != "cpu" and q.dtype in _HALF
    if name == "flash" or (name == "auto" and fast_ok and flash_attention_backend.flash_attn_available()):
        return flash_varlen
    if name == "torch_varlen" or (name == "auto" and fast_ok and _torch_varlen_fn() is not None):
        return torch_varlen
    return sdpa_varlen


class CausalVarlenAttention:
    """Callable local attention: `(q, k, v, cu_seqlens, max_seqlen, scaling) -> out (T, Hq, D)`."""

    def __init__(self, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"local attention: unknown backend {backend!r}; one of {', '.join(BACKENDS)}")
        self.backend = backend

    def __call__(self, q, k, v, cu_seqlens: Sequence[int], max_seqlen: int, scaling: float | None = None):
        return pick_backend(self.backend, q)(q, k, v, cu_seqlens, max_seqlen, scaling)
