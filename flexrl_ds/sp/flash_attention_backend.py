"""flash-attn's varlen kernel, the only file that imports `flash_attn` (architecture rule)."""

from __future__ import annotations


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return True


def flash_varlen(q, k, v, cu_seqlens_t, max_seqlen: int, scaling: float | None, causal: bool = True):
    """Varlen attention with flash-attn: q (T, Hq, D), k/v (T, Hk, D), Hq % Hk == 0 (GQA native)."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(q, k, v, cu_seqlens_t, cu_seqlens_t, max_seqlen, max_seqlen,
                                  softmax_scale=scaling, causal=causal)
