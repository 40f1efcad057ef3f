"""The ONE place that plugs FlexUlysses into transformers' attention plumbing (no monkey-patching).

- `register()` adds an attention function named "flexrl_ulysses" through
  `transformers.AttentionInterface.register`, and a mask function of the same name returning None
  through `transformers.masking_utils.AttentionMaskInterface.register` (packs carry their own causal
  structure; a dense (L, L) mask is never built).
- `use_flex_ulysses(model)` selects it with `model.set_attn_implementation(...)`: for Qwen2.5-VL a dict
  puts the LLM on FlexUlysses and the vision tower on "flexrl_flash_varlen" (below).
- "flexrl_flash_varlen", the vision tower's attention: one varlen call per layer over all the
  windows (or frames) of the rank's units, bidirectional within each (torch's varlen kernel on the
  GPU, flash-attn where installed, SDPA per window elsewhere). transformers' vision towers pass
  `cu_seq_lens_q` and `max_length_q` only to implementations whose name holds "flash"
  (`is_flash_attention_requested`), hence the name; under "sdpa" they call the attention once per
  window from Python, thousands of small calls a layer for a step's videos.
- The per-step pack layout reaches the attention as an extra keyword argument of the model's forward
  (`flexrl_step=FlexStep(layout, attention)`): transformers forwards unknown kwargs from the model's
  `forward` down to every attention call unchanged.

The attention gets `query` (1, heads, local_tokens, head_dim) with rotary applied and returns
(1, local_tokens, heads, head_dim); FlexUlyssesAttention works on (tokens, heads, head_dim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flexrl_ds.sp.local_attention import pick_backend, sdpa_varlen

ATTENTION_NAME = "flexrl_ulysses"
VISION_ATTENTION_NAME = "flexrl_flash_varlen"
"""The vision tower's attention ("flash" in the name: see the module docstring)."""
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
        out = sdpa_varlen(q, k, v, [0, q.shape[0]], q.shape[0], scaling)
        if step.layout.packs:  # packs whose other ranks hold tokens: join their exchanges with none
            out = out + step.attention(q[:0], k[:0], v[:0], step.layout, scaling).sum() * 0.0
    else:
        out = step.attention(q, k, v, step.layout, scaling)
    return out.unsqueeze(0), None


def varlen_vision_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function for vision towers: bidirectional attention within each
    [cu[i], cu[i+1]) of `cu_seq_lens_q`, in one call over all of them."""
    bounds, longest = kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q")
    if bounds is None or longest is None:
        raise ValueError(f"attention {VISION_ATTENTION_NAME!r} needs cu_seq_lens_q and max_length_q (a vision "
                         f"tower's varlen call); {type(module).__name__} passed neither")
    if query.shape[0] != 1 or dropout:
        raise ValueError(f"attention {VISION_ATTENTION_NAME!r}: batch must be 1 and dropout 0, got batch "
                         f"{query.shape[0]}, dropout {dropout}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    out = pick_backend("auto", q)(q, k, v, bounds, int(longest), scaling, causal=False)
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
    transformers.AttentionInterface.register(VISION_ATTENTION_NAME, varlen_vision_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_dense_mask)
    _registered = True


def is_vision_language(model) -> bool:
    """True for models with a vision sub-config (Qwen2.5-VL); False for text-only models (Qwen2)."""
    return getattr(model.config, "vision_config", None) is not None


def use_flex_ulysses(model, vision_attention: str = "varlen"):
    """Put the LLM's attention on FlexUlysses and a vision tower's on `vision_attention`: "varlen"
    (VISION_ATTENTION_NAME) or "sdpa" (transformers' per-window calls); returns the model."""
    if vision_attention not in ("varlen", "sdpa"):
        raise ValueError(f"vision attention: 'varlen' or 'sdpa', got {vision_attention!r}")
    register()
    if not is_vision_language(model):
        model.set_attn_implementation(ATTENTION_NAME)
        return model
    model.set_attn_implementation({"text_config": ATTENTION_NAME, "vision_config": "sdpa"})
    if vision_attention == "varlen":
        # Set on the vision config itself: `set_attn_implementation` takes any name holding "flash"
        # for a flash-attn kernel to import or download, although a registered function needs neither.
        model.config.vision_config._attn_implementation = VISION_ATTENTION_NAME
    return model


def text_config(model):
    """The LLM's config (the text sub-config of a VLM, the config itself for a text model)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config
