"""The ONE place that plugs FlexUlysses into transformers' attention plumbing (no monkey-patching).

- `register()` adds an attention function named "flexrl_ulysses" through
  `transformers.AttentionInterface.register`, and a mask function of the same name returning None
  through `transformers.masking_utils.AttentionMaskInterface.register` (packs carry their own causal
  structure; a dense (L, L) mask is never built).
- `use_flex_ulysses(model)` selects it with `model.set_attn_implementation(...)`: for Qwen2.5-VL a dict
  keeps the vision tower on sdpa and puts only the LLM on FlexUlysses.
- The per-step pack layout reaches the attention as an extra keyword argument of the model's forward
  (`flexrl_step=FlexStep(layout, attention)`): transformers forwards unknown kwargs from the model's
  `forward` down to every attention call unchanged.

The attention gets `query` (1, heads, local_tokens, head_dim) with rotary applied and returns
(1, local_tokens, heads, head_dim); FlexUlyssesAttention works on (tokens, heads, head_dim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flexrl_ds.sp.local_attention import sdpa_causal_varlen

ATTENTION_NAME = "flexrl_ulysses"
STEP_KWARG = "flexrl_step"
"""Name of the forward keyword that carries the step's `FlexStep`."""


@dataclass(frozen=True)
class FlexStep:
    """What the attention needs for one step on one rank (passed as `flexrl_step=` to forward)."""

    layout: Any
    """This rank's `RankLayout` (flexrl_ds/sp/layout.py): packs in HSF order, groups, shards."""
    attention: Any
    """A `FlexUlyssesAttention` (or any callable `(q, k, v, layout, scaling) -> out`)."""
    idle: bool = False
    """This rank holds no token this step and runs a 1-token placeholder forward (so ZeRO-3's
    collective parameter gathers still happen): the placeholder's attention is local, and the rank
    joins the all-to-alls of its packs (if any: e.g. a 5-token sequence at degree 8) with 0 tokens."""


def flex_ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function: FlexUlysses over the step's packs."""
    step = kwargs.get(STEP_KWARG)
    if step is None:
        raise ValueError(f"attention {ATTENTION_NAME!r} needs the forward keyword {STEP_KWARG}=FlexStep(...)")
    if query.shape[0] != 1:
        raise ValueError(f"attention {ATTENTION_NAME!r}: batch must be 1 (local tokens of all packs in one "
                         f"row), got {query.shape[0]}")
    if dropout:
        raise ValueError(f"attention {ATTENTION_NAME!r} does not implement attention dropout")
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    if step.idle:
        out = sdpa_causal_varlen(q, k, v, [0, q.shape[0]], q.shape[0], scaling)
        if step.layout.packs:  # packs whose other ranks hold tokens: join their exchanges with none
            out = out + step.attention(q[:0], k[:0], v[:0], step.layout, scaling).sum() * 0.0
    else:
        out = step.attention(q, k, v, step.layout, scaling)
    return out.unsqueeze(0), None


def _no_dense_mask(*args, **kwargs):
    """Mask function: FlexUlysses knows sequence boundaries from the layout, so no mask tensor."""
    return None


_registered = False


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    import transformers
    from transformers.masking_utils import AttentionMaskInterface

    transformers.AttentionInterface.register(ATTENTION_NAME, flex_ulysses_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_dense_mask)
    _registered = True


def is_vision_language(model) -> bool:
    """True for models with a vision sub-config (Qwen2.5-VL); False for text-only models (Qwen2)."""
    return getattr(model.config, "vision_config", None) is not None


def use_flex_ulysses(model, vision_attention: str = "sdpa"):
    """Put the LLM's attention on FlexUlysses (vision tower on `vision_attention`); returns the model."""
    register()
    if is_vision_language(model):
        model.set_attn_implementation({"text_config": ATTENTION_NAME, "vision_config": vision_attention})
    else:
        model.set_attn_implementation(ATTENTION_NAME)
    return model


def text_config(model):
    """The LLM's config (the text sub-config of a VLM, the config itself for a text model)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config
