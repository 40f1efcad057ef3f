"""Position ids under FlexUlysses: computed per WHOLE sequence, then cut to a rank's local tokens.

Qwen2.5-VL's 3D (mRoPE) positions of a token depend on every vision grid before it, so a shard cannot
compute its own: `sequence_positions` runs the model's rope-index logic on the whole sequence and
`local_position_ids` slices the result with the rank layout into `(3, 1, local_tokens)` (or
`(1, local_tokens)` for text models), which the model gets explicitly as `position_ids`.

`rope_index` is the one wrapper around transformers' `get_rope_index`, whose signature differs across
transformers 5.x (5.24 needs `mm_token_type_ids`; earlier 5.x releases derive token types from ids).
"""

from __future__ import annotations

import inspect
from typing import Mapping, Sequence

import torch

IMAGE_TYPE, VIDEO_TYPE = 1, 2


def mm_token_type_ids(input_ids_L: torch.Tensor, image_token_id: int, video_token_id: int) -> torch.Tensor:
    """0 for text, 1 for image tokens, 2 for video tokens (what the HF processor returns)."""
    types = torch.zeros_like(input_ids_L, dtype=torch.int32)
    types[input_ids_L == image_token_id] = IMAGE_TYPE
    types[input_ids_L == video_token_id] = VIDEO_TYPE
    return types


def _grid_tensor(grids: Sequence[tuple[int, int, int]]) -> torch.Tensor | None:
    return torch.tensor([list(g) for g in grids], dtype=torch.long) if grids else None


def rope_index(vl_model, input_ids_L: torch.Tensor, image_grids: Sequence[tuple[int, int, int]],
               video_grids: Sequence[tuple[int, int, int]], second_per_grid_ts: Sequence[float]) -> torch.Tensor:
    """(3, L) mRoPE positions of one whole sequence via the model's own `get_rope_index`.

    `vl_model` is the `Qwen2_5_VLModel` (`model.model` of the conditional-generation class).
    """
    config = vl_model.config
    input_ids = input_ids_L.view(1, -1)
    kwargs = dict(image_grid_thw=_grid_tensor(image_grids), video_grid_thw=_grid_tensor(video_grids),
                  second_per_grid_ts=torch.tensor(list(second_per_grid_ts)) if video_grids else None,
                  attention_mask=None)
    params = inspect.signature(vl_model.get_rope_index).parameters
    if "mm_token_type_ids" in params:
        kwargs["mm_token_type_ids"] = mm_token_type_ids(input_ids, config.image_token_id,
                                                        config.video_token_id)
    position_ids, _ = vl_model.get_rope_index(input_ids, **kwargs)
    return position_ids[:, 0, :]


def sequence_positions(model, input_ids_L: torch.Tensor, items=()) -> torch.Tensor:
    """Whole-sequence positions: (3, L) for a vision-language model, (1, L) for a text model.

    `items`: the sequence's `VisionItem`s in prompt order (kind, grid_thw, second_per_grid_t).
    """
    length = int(input_ids_L.shape[0])
    if getattr(model.config, "vision_config", None) is None:
        if items:
            raise ValueError("sequence has vision items but the model is text-only")
        return torch.arange(length, dtype=torch.long).view(1, length)
    if not items:
        return torch.arange(length, dtype=torch.long).view(1, length).expand(3, length).contiguous()
    images = [tuple(i.grid_thw) for i in items if i.kind == "image"]
    videos = [tuple(i.grid_thw) for i in items if i.kind == "video"]
    seconds = [i.second_per_grid_t for i in items if i.kind == "video"]
    return rope_index(_vl_base(model), input_ids_L, images, videos, seconds)


def _vl_base(model):
    """The module holding `get_rope_index` (Qwen2_5_VLModel) for the model or a wrapper of it."""
    for candidate in (model, getattr(model, "model", None)):
        if candidate is not None and hasattr(candidate, "get_rope_index"):
            return candidate
    raise ValueError(f"{type(model).__name__} has no get_rope_index (not a Qwen2-VL-style model)")


def local_position_ids(layout, positions_by_seq: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """This rank's positions in local token order with a batch axis of 1: (3, 1, local) for mRoPE
    positions, (1, local) for 1D positions (text models)."""
    local = layout.slice_tokens(positions_by_seq, dim=-1)
    return local.unsqueeze(1) if local.shape[0] == 3 else local
