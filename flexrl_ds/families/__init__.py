"""Model families: what differs between the vision-language models flexrl_ds trains, one module each.

A family is chosen by the HF config's `model_type` from `REGISTRY` (one line per family). Its module
owns everything family-specific (flexrl_ds/families/base.py lists it): processor classes and their
defaults, video frame sampling and resize rules, prompt expansion (pads, timestamps), mRoPE positions,
the vision tower call and what it returns, the decoder call with its extra inputs, plain-HF reference
inputs, the vLLM request's multimodal metadata and weight names, vision FLOPs, and the tiny model.

This package imports only `flexrl_ds.common` (media/ and models/ both use it), and nothing heavier than
the standard library at import time: loading a run config never imports torch. Model types that are
known but cannot be sharded yet are in `NOT_SHARDABLE`, with the reason `family_for` gives before any
worker starts.

Adding a family: its module here (a `ModelFamily` subclass and `FAMILY`), its tests, and its line in
`REGISTRY`.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from flexrl_ds.families.base import TEXT

REGISTRY = {
    "qwen2_5_vl": "flexrl_ds.families.qwen2_5_vl:QWEN2_5_VL",
    "qwen2_vl": "flexrl_ds.families.qwen2_5_vl:QWEN2_VL",
    "qwen3_vl": "flexrl_ds.families.qwen3_vl:QWEN3_VL",
    "qwen3_vl_moe": "flexrl_ds.families.qwen3_vl_moe:QWEN3_VL_MOE",
}
"""HF `model_type` -> "module:attribute" of its `ModelFamily` (imported on first use)."""

NOT_SHARDABLE = {
    "qwen3_5": "most of its decoder layers are Gated DeltaNet (linear attention), which does not go through "
               "transformers' attention interface, so FlexUlysses cannot shard them",
    "qwen3_5_moe": "most of its decoder layers are Gated DeltaNet (linear attention), which does not go through "
                   "transformers' attention interface, so FlexUlysses cannot shard them",
    "gemma3": "its vision spans need bidirectional attention and its layers sliding windows, which FlexUlysses' "
              "causal packs do not implement",
}
"""Known model types flexrl_ds refuses, and why (said before any worker starts)."""

TEXT_FAMILY = "text"
"""The family of every text-only causal LM (a config without `vision_config`)."""


def family_for(model_type: str | None, has_vision: bool = True):
    """The `ModelFamily` of an HF `model_type` (a text-only model: the text family). ValueError names
    a refused family and why, or an unknown one and those registered."""
    if not has_vision:
        return TEXT
    if model_type in NOT_SHARDABLE:
        raise ValueError(f"model family {model_type!r} cannot be trained by flexrl_ds yet: {NOT_SHARDABLE[model_type]}")
    if model_type not in REGISTRY:
        raise ValueError(f"model family {model_type!r} is not supported; flexrl_ds trains "
                         f"{', '.join(sorted(REGISTRY))} (flexrl_ds/families/)")
    module, attribute = REGISTRY[model_type].split(":")
    return getattr(importlib.import_module(module), attribute)


def family_of(config):
    """The family of an HF config (or a model: its config)."""
    config = getattr(config, "config", config)
    return family_for(getattr(config, "model_type", None), getattr(config, "vision_config", None) is not None)


def family_of_dir(model_dir: str | Path):
    """The family of a model directory, from its config.json (without importing transformers)."""
    path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{model_dir}: cannot read config.json ({error})") from None
    return family_for(raw.get("model_type"), "vision_config" in raw)


def check_trainable(model_dir: str | Path) -> None:
    """ValueError (naming the family and why) for a model directory flexrl_ds cannot shard."""
    family_of_dir(model_dir)
