"""Causal attention over the packed sequences of one pack, on one rank (no communication).

`causal_varlen_attention(q, k, v, cu_seqlens, max_seqlen, scaling)`: q (T, Hq, D), k/v (T, Hk, D)
with Hq a multiple of Hk (query head i uses KV head i // (Hq/Hk)); each sequence [cu[i], cu[i+1])
attends causally to itself only. Backends, same results:
- `flash`: flash-attn varlen (if installed; GPU, fp16/bf16),
- `torch_varlen`: torch.nn.attention.varlen.varlen_attn (if present; GPU, fp16/bf16),
- `sdpa`: scaled_dot_product_attention per sequence with a causal mask (everywhere, any dtype).
`auto` picks the first that fits the tensors.
"""

from __future__ import annotations

import inspect
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from flexrl_ds.sp import flash_attention_backend

BACKENDS = ("auto", "flash", "torch_varlen", "sdpa")
_HALF = (torch.float16, torch.bfloat16)


def sdpa_causal_varlen(q, k, v, cu_seqlens: Sequence[int], max_seqlen: int, scaling: float | None):
    """Reference backend: SDPA on each sequence (GQA by repeating KV heads)."""
    repeat = q.shape[1] // k.shape[1]
    outs = []
    for start, end in zip(cu_seqlens, cu_seqlens[1:]):
        q_s = q[start:end].transpose(0, 1).unsqueeze(0)
        k_s = k[start:end].transpose(0, 1).unsqueeze(0)
        v_s = v[start:end].transpose(0, 1).unsqueeze(0)
        if repeat > 1:
            k_s, v_s = k_s.repeat_interleave(repeat, dim=1), v_s.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=True, scale=scaling)
        outs.append(out.squeeze(0).transpose(0, 1))
    if not outs:
        return q.new_empty(q.shape)
    return torch.cat(outs)


def _torch_varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception:
        return None
    return varlen_attn


def torch_varlen_causal(q, k, v, cu_seqlens: Sequence[int], max_seqlen: int, scaling: float | None):
    """torch's varlen kernel (causal spelled per torch release: is_causal=True or window (-1, 0))."""
    varlen_attn = _torch_varlen_fn()
    cu = torch.tensor(list(cu_seqlens), dtype=torch.int32, device=q.device)
    params = inspect.signature(varlen_attn).parameters
    kwargs = {"scale": scaling}
    kwargs.update({"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)})
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            repeat = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    return varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)


def _flash(q, k, v, cu_seqlens, max_seqlen, scaling):
    cu = torch.tensor(list(cu_seqlens), dtype=torch.int32, device=q.device)
    return flash_attention_backend.flash_causal_varlen(q, k, v, cu, max_seqlen, scaling)


def pick_backend(name: str, q) -> Callable:
    """The attention function for backend `name` (see module doc) and tensors like `q`."""
    if name not in BACKENDS:
        raise ValueError(f"local attention: unknown backend {name!r}; one of {', '.join(BACKENDS)}")
    fast_ok = q.device.type != "cpu" and q.dtype in _HALF
    if name == "flash" or (name == "auto" and fast_ok and flash_attention_backend.flash_attn_available()):
        return _flash
    if name == "torch_varlen" or (name == "auto" and fast_ok and _torch_varlen_fn() is not None):
        return torch_varlen_causal
    return sdpa_causal_varlen


class CausalVarlenAttention:
    """Callable local attention: `(q, k, v, cu_seqlens, max_seqlen, scaling) -> out (T, Hq, D)`."""

    def __init__(self, backend: str = "auto"):
        if backend not in BACKENDS:
            raise ValueError(f"local attention: unknown backend {backend!r}; one of {', '.join(BACKENDS)}")
        self.backend = backend

    def __call__(self, q, k, v, cu_seqlens: Sequence[int], max_seqlen: int, scaling: float | None = None):
        return pick_backend(self.backend, q)(q, k, v, cu_seqlens, max_seqlen, scaling)
