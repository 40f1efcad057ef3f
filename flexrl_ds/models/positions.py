"""Position ids under FlexUlysses: computed per WHOLE sequence, then cut to a rank's local tokens.

Qwen2.5-VL's 3D (mRoPE) positions of a token depend on every vision grid before it, so a shard cannot
compute its own: `sequence_positions` computes them for the whole sequence and `local_position_ids`
slices the result with the rank layout into `(3, 1, local_tokens)` (or `(1, local_tokens)` for text
models), which the model gets explicitly as `position_ids`.

Each family computes its own (`ModelFamily.sequence_positions`, flexrl_ds/families/; Qwen3-VL's equals
transformers' `get_rope_index`, a (1, h, w) grid per image and video frame group). Qwen2.5-VL's rule
(`mrope_positions`, in flexrl_ds/families/qwen2_5_vl.py) is Qwen2-VL's / Qwen2.5-VL's as released (and
as vLLM computes it): text tokens advance all three coordinates together; a vision item's tokens, in
(t, h, w) order, get (start + T(t), start + h, start + w) with `start` the next free position,
where T(t) = t for images and Qwen2-VL videos and floor(t * second_per_grid_t * tokens_per_second)
for Qwen2.5-VL videos; the text after an item starts at the item's largest position + 1. It is computed
here, not by transformers' `get_rope_index`, because that one changed across transformers 5.x: 5.17 truncates
second_per_grid_t to an integer first, and 5.x starts the text after a video at start + max(h, w)
even when the video's temporal positions reach further. Against a vLLM engine that gave a
log-prob gap of ~1 nat per token on such videos (docs/notes/one-h200-runs-2026-12-01.md, "One H200,
third run").
"""

from __future__ import annotations

from typing import Mapping

import torch

from flexrl_ds.families import family_of
from flexrl_ds.families.qwen2_5_vl import MropeSpec, mm_token_type_ids, mrope_positions

__all__ = ["MropeSpec", "local_position_ids", "mm_token_type_ids", "mrope_positions", "sequence_positions"]
IMAGE_TYPE, VIDEO_TYPE = 1, 2


def sequence_positions(model, input_ids_L: torch.Tensor, items=()) -> torch.Tensor:
    """Whole-sequence positions: (3, L) for a vision-language model, (1, L) for a text model.

    `model`: the HF model (or its config). `items`: the sequence's `VisionItem`s in prompt order
    (kind, grid_thw, second_per_grid_t).
    """
    config = getattr(model, "config", model)
    return family_of(config).sequence_positions(config, input_ids_L, items)


def local_position_ids(layout, positions_by_seq: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """This rank's positions in local token order with a batch axis of 1: (3, 1, local) for mRoPE
    positions, (1, local) for 1D positions (text models)."""
    local = layout.slice_tokens(positions_by_seq, dim=-1)
    return local.unsqueeze(1) if local.shape[0] == 3 else local
