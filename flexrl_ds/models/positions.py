"""Position ids under FlexUlysses: computed per WHOLE sequence, then cut to a rank's local tokens.

Qwen2.5-VL's 3D (mRoPE) positions of a token depend on every vision grid before it, so a shard cannot
compute its own: `sequence_positions` computes them for the whole sequence and `local_position_ids`
slices the result with the rank layout into `(3, 1, local_tokens)` (or `(1, local_tokens)` for text
models), which the model gets explicitly as `position_ids`.

The rule is Qwen2-VL's / Qwen2.5-VL's as released (and as vLLM computes it): text tokens advance all
three coordinates together; a vision item's tokens, in (t, h, w) order, get (start + T(t), start + h,
start + w) with `start` the next free position, where T(t) = t for images and Qwen2-VL videos and
floor(t * second_per_grid_t * tokens_per_second) for Qwen2.5-VL videos; the text after an item
starts at the item's largest position + 1. It is computed here, not by transformers'
`get_rope_index`, because that one changed across transformers 5.x: 5.17 truncates
second_per_grid_t to an integer first, and 5.x starts the text after a video at start + max(h, w)
even when the video's temporal positions reach further. Against a vLLM engine that gave a
log-prob gap of ~1 nat per token on such videos (docs/notes/one-h200-runs-2026-12-01.md, "One H200,
third run").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

IMAGE_TYPE, VIDEO_TYPE = 1, 2


def mm_token_type_ids(input_ids_L: torch.Tensor, image_token_id: int, video_token_id: int) -> torch.Tensor:
    """0 for text, 1 for image tokens, 2 for video tokens (what the HF processor returns)."""
    types = torch.zeros_like(input_ids_L, dtype=torch.int32)
    types[input_ids_L == image_token_id] = IMAGE_TYPE
    types[input_ids_L == video_token_id] = VIDEO_TYPE
    return types


@dataclass(frozen=True)
class MropeSpec:
    """What Qwen2-VL / Qwen2.5-VL mRoPE positions depend on (from the HF config)."""

    image_token_id: int
    video_token_id: int
    spatial_merge_size: int
    tokens_per_second: float | None
    """Qwen2.5-VL: temporal position units per second of video; None (Qwen2-VL): one per temporal group."""

    @classmethod
    def from_config(cls, config) -> "MropeSpec":
        vision = config.vision_config
        return cls(int(config.image_token_id), int(config.video_token_id), int(vision.spatial_merge_size),
                   getattr(vision, "tokens_per_second", None))


def _vision_block(item, start: int, spec: MropeSpec) -> torch.Tensor:
    """(3, t*H*W) positions of one vision item's tokens (t, h/merge, w/merge order), from `start`."""
    t, h, w = (int(v) for v in item.grid_thw)
    rows, cols = h // spec.spatial_merge_size, w // spec.spatial_merge_size
    factor = 1.0
    if item.kind == "video" and spec.tokens_per_second is not None:
        # second_per_grid_t as the processors hold it (a float32 tensor: what vLLM reads back)
        second = float(torch.tensor(float(item.second_per_grid_t), dtype=torch.float32))
        factor = second * float(spec.tokens_per_second)
    temporal = torch.tensor([int(index * factor) for index in range(t)], dtype=torch.long)  # truncated
    grid_t, grid_h, grid_w = torch.meshgrid(temporal, torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + start


def mrope_positions(input_ids_L: torch.Tensor, items: Sequence, spec: MropeSpec) -> torch.Tensor:
    """(3, L) positions of one whole sequence by the Qwen2-VL / Qwen2.5-VL rule (module docstring).

    `items`: the sequence's vision items in prompt order; item k owns the next run of
    t*h*w/merge^2 pad tokens of its kind. ValueError when the pads and the items disagree.
    """
    ids = input_ids_L.tolist()
    pad_ids = {"image": spec.image_token_id, "video": spec.video_token_id}
    chunks, next_position, cursor = [], 0, 0
    for index, item in enumerate(items):
        pad = pad_ids[item.kind]
        count = item.num_tokens(spec.spatial_merge_size)
        where = f"vision item {index} ({item.kind}, grid {tuple(item.grid_thw)})"
        if count < 1 or (item.kind == "image" and int(item.grid_thw[0]) != 1):
            raise ValueError(f"{where}: an image has one temporal group and every item at least one token")
        start = next((i for i in range(cursor, len(ids)) if ids[i] in pad_ids.values()), None)
        if start is None or ids[start:start + count] != [pad] * count:
            raise ValueError(f"{where}: expected a run of {count} pad tokens {pad} as the next vision "
                             f"tokens after token {cursor}")
        chunks.append(torch.arange(start - cursor).expand(3, -1) + next_position)
        block = _vision_block(item, next_position + start - cursor, spec)
        chunks.append(block)
        next_position, cursor = int(block.max()) + 1, start + count
    left = [i for i in range(cursor, len(ids)) if ids[i] in pad_ids.values()]
    if left:
        raise ValueError(f"{len(left)} vision pad tokens after the last of {len(items)} vision items "
                         f"(first at token {left[0]})")
    chunks.append(torch.arange(len(ids) - cursor).expand(3, -1) + next_position)
    return torch.cat(chunks, dim=1).to(torch.long)


def sequence_positions(model, input_ids_L: torch.Tensor, items=()) -> torch.Tensor:
    """Whole-sequence positions: (3, L) for a vision-language model, (1, L) for a text model.

    `model`: the HF model (or its config). `items`: the sequence's `VisionItem`s in prompt order
    (kind, grid_thw, second_per_grid_t).
    """
    config = getattr(model, "config", model)
    length = int(input_ids_L.shape[0])
    if getattr(config, "vision_config", None) is None:
        if items:
            raise ValueError("sequence has vision items but the model is text-only")
        return torch.arange(length, dtype=torch.long).view(1, length)
    return mrope_positions(input_ids_L, items, MropeSpec.from_config(config))


def local_position_ids(layout, positions_by_seq: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """This rank's positions in local token order with a batch axis of 1: (3, 1, local) for mRoPE
    positions, (1, local) for 1D positions (text models)."""
    local = layout.slice_tokens(positions_by_seq, dim=-1)
    return local.unsqueeze(1) if local.shape[0] == 3 else local
