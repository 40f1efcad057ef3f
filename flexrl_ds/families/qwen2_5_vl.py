"""Qwen2.5-VL (`qwen2_5_vl`) and Qwen2-VL (`qwen2_vl`): the family flexrl_ds started with.

- Media (transformers 5.x `Qwen2VLImageProcessor` / `Qwen2VLVideoProcessor`): patch 14, merge 2,
  temporal patch 2; `fit_to_patch_grid` is their `smart_resize` per frame; videos sampled at fps and
  rounded down to whole temporal patches (`sample_frame_positions`); CLIP mean/std.
- Prompts: each rendered `<|image_pad|>` / `<|video_pad|>` becomes t*h*w/merge² copies (one run per item).
- Positions: the released mRoPE rule (`mrope_positions`; why not transformers' own: models/positions.py).
- Tower: `visual(pixels, grid_thw).pooler_output`; a video's temporal groups encode independently
  (window attention within a group), so every group is a unit of vision balancing.
- Decoder: `hf_model.model(inputs_embeds=..., position_ids=...)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from flexrl_ds.families.base import ModelFamily

MAX_ASPECT_RATIO = 200
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
IMAGE, VIDEO = "image", "video"


def fit_to_patch_grid(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor`, scaled into [min_pixels, max_pixels] with
    the aspect ratio kept as far as possible (Qwen2-VL's `smart_resize` rule)."""
    if min(height, width) <= 0:
        raise ValueError(f"image size {width}x{height} is empty")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio of {width}x{height} exceeds {MAX_ASPECT_RATIO}")
    rounded_h = round(height / factor) * factor
    rounded_w = round(width / factor) * factor
    if rounded_h * rounded_w > max_pixels:
        shrink = math.sqrt(height * width / max_pixels)
        return (max(factor, math.floor(height / shrink / factor) * factor),
                max(factor, math.floor(width / shrink / factor) * factor))
    if rounded_h * rounded_w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        return (math.ceil(height * grow / factor) * factor, math.ceil(width * grow / factor) * factor)
    return rounded_h, rounded_w


def sample_frame_positions(num_frames: int, video_fps: float, target_fps: float, min_frames: int,
                           max_frames: int, temporal_patch_size: int) -> list[int]:
    """Positions (0-based, within the `num_frames` given) sampled at `target_fps`: the count is
    clamped to [min_frames, max_frames] and to the frames present, then rounded down to whole
    temporal patches; positions are spread evenly (HF Qwen2-VL video processor, fps mode).

    HF computes the positions as `arange(0, n, n / count)` in float32; for many (n, count) pairs
    (e.g. 185 frames, count 46) rounding adds one more position, equal to n, past the last frame,
    where HF's own decoding then fails. That position is dropped here; every other position, and
    the extra one when it lands on n - 1, is kept exactly as HF has it."""
    import torch

    cap = math.floor(min(max_frames, num_frames) / temporal_patch_size) * temporal_patch_size
    wanted = num_frames / video_fps * target_fps
    count = min(max(wanted, min_frames), cap, num_frames)
    count = math.floor(count / temporal_patch_size) * temporal_patch_size
    if count <= 0:
        raise ValueError(
            f"video has {num_frames} frame(s) in range; at least {temporal_patch_size} are needed"
        )
    positions = torch.arange(0, num_frames, num_frames / count).int().tolist()
    return [position for position in positions if position < num_frames]


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


def _vision_block(item, start: int, spec: MropeSpec):
    """(3, t*H*W) positions of one vision item's tokens (t, h/merge, w/merge order), from `start`."""
    import torch

    t, h, w = (int(v) for v in item.grid_thw)
    rows, cols = h // spec.spatial_merge_size, w // spec.spatial_merge_size
    factor = 1.0
    if item.kind == VIDEO and spec.tokens_per_second is not None:
        # second_per_grid_t as the processors hold it (a float32 tensor: what vLLM reads back)
        second = float(torch.tensor(float(item.second_per_grid_t), dtype=torch.float32))
        factor = second * float(spec.tokens_per_second)
    temporal = torch.tensor([int(index * factor) for index in range(t)], dtype=torch.long)  # truncated
    grid_t, grid_h, grid_w = torch.meshgrid(temporal, torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + start


def mrope_positions(input_ids_L, items: Sequence, spec: MropeSpec):
    """(3, L) positions of one whole sequence by the Qwen2-VL / Qwen2.5-VL rule (models/positions.py).

    `items`: the sequence's vision items in prompt order; item k owns the next run of
    t*h*w/merge^2 pad tokens of its kind. ValueError when the pads and the items disagree.
    """
    import torch

    ids = input_ids_L.tolist()
    pad_ids = {IMAGE: spec.image_token_id, VIDEO: spec.video_token_id}
    chunks, next_position, cursor = [], 0, 0
    for index, item in enumerate(items):
        pad = pad_ids[item.kind]
        count = item.num_tokens(spec.spatial_merge_size)
        where = f"vision item {index} ({item.kind}, grid {tuple(item.grid_thw)})"
        if count < 1 or (item.kind == IMAGE and int(item.grid_thw[0]) != 1):
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


def mm_token_type_ids(input_ids_L, image_token_id: int, video_token_id: int):
    """0 for text, 1 for image tokens, 2 for video tokens (what the HF processor returns)."""
    import torch

    types = torch.zeros_like(input_ids_L, dtype=torch.int32)
    types[input_ids_L == image_token_id] = 1
    types[input_ids_L == video_token_id] = 2
    return types


class Qwen2_5_VL(ModelFamily):
    """Qwen2.5-VL; `Qwen2_VL` differs only in its videos' temporal positions (no tokens_per_second)."""

    model_type = "qwen2_5_vl"
    display_name = "Qwen2.5-VL"
    hf_class = "Qwen2_5_VLForConditionalGeneration"
    processor_classes: tuple[str, ...] = ("Qwen2_5_VLProcessor", "Qwen2VLProcessor")
    image_processor_types = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
    video_processor_types = ("Qwen2VLVideoProcessor",)
    processor_defaults = {
        "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_resize": True, "resample": 3, "do_convert_rgb": True,
        "min_frames": 4, "max_frames": 768, "max_video_tokens": 128000,
    }
    image_size_default = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}
    video_size_default = {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}
    pad_tokens = {IMAGE: "<|image_pad|>", VIDEO: "<|video_pad|>"}

    # ---- media ----------------------------------------------------------------------------------------
    def video_frame_positions(self, num_frames, video_fps, target_fps, min_frames, max_frames, temporal_patch_size):
        return sample_frame_positions(num_frames, video_fps, target_fps, min_frames, max_frames, temporal_patch_size)

    def video_frame_size(self, height, width, num_sampled, config, max_pixels):
        """Qwen2-VL: `smart_resize` per frame; `video_max_total_tokens` (cap_pixels_per_frame) shrinks
        each frame so the whole video stays within 90% of that many tokens' pixels."""
        if config.video_max_total_tokens is not None:
            total_pixels = int(config.video_max_total_tokens * config.factor * config.factor * 0.9)
            max_pixels = max(min(max_pixels, total_pixels * config.temporal_patch_size // num_sampled),
                             int(config.video_min_pixels * 1.05))
        return fit_to_patch_grid(height, width, config.factor, config.video_min_pixels, max_pixels)

    # ---- prompts and positions --------------------------------------------------------------------------
    def expand_pads(self, record_id, text, items, merge_size, temporal_patch_size=2):
        """Each rendered pad token becomes one pad per merged vision token of its item (in order)."""
        import re

        kinds = {token: kind for kind, token in self.pad_tokens.items()}
        pieces = re.split("(" + "|".join(re.escape(t) for t in kinds) + ")", text)
        pads = pieces[1::2]
        if [kinds[p] for p in pads] != [item.kind for item in items]:
            raise ValueError(f"record {record_id!r}: rendered prompt has vision pads {pads} but the "
                             f"media items are {[item.kind for item in items]}")
        for index, item in enumerate(items):
            pieces[2 * index + 1] = self.item_text(item, pads[index], merge_size, temporal_patch_size)
        return "".join(pieces)

    def item_text(self, item, pad: str, merge_size: int, temporal_patch_size: int = 2) -> str:
        """What one rendered pad of `item` becomes."""
        return pad * item.num_tokens(merge_size)

    def sequence_positions(self, config, input_ids_L, items):
        return mrope_positions(input_ids_L, items, MropeSpec.from_config(config))

    # ---- model calls ------------------------------------------------------------------------------------
    def vision_tower(self, hf_model):
        return hf_model.model.visual

    def encode_vision(self, visual, pixels, grids, inputs=None):
        return visual(pixels, grid_thw=grids, **(inputs or {})).pooler_output, None

    def vision_call_inputs(self, visual, grids):
        """Those of `Qwen2_5_VisionTransformerPretrainedModel.forward`: `vision_sequence_inputs`, and
        the window blocks' order, bounds and longest window."""
        # lazy: transformers is imported where a model is
        from transformers.utils.generic import get_max_seqlen
        from transformers.vision_utils import get_vision_window_index

        window_index, cu_window_seqlens = get_vision_window_index(
            grids, spatial_merge_size=visual.spatial_merge_size, window_size=visual.window_size,
            patch_size=visual.patch_size)
        inputs = {**vision_sequence_inputs(visual, grids), "window_index": window_index,
                  "cu_window_seqlens": cu_window_seqlens,
                  "max_window_seqlen": get_max_seqlen(cu_window_seqlens, visual.config)}
        return {key: value for key, value in inputs.items() if value is not None}

    def reference_inputs(self, model, sample):
        """Pixels, grids, `second_per_grid_ts`, `mm_token_type_ids`, and the sequence's mRoPE
        `position_ids` (3, 1, L) of `mrope_positions` (models/positions.py says why not HF's own)."""
        kwargs = self.media_inputs(model, sample)
        videos = [i for i in sample.items if i.kind == VIDEO]
        if videos:
            import torch

            kwargs["second_per_grid_ts"] = torch.tensor([i.second_per_grid_t for i in videos])
        kwargs["position_ids"] = self.sequence_positions(model.config, sample.input_ids, sample.items).unsqueeze(1)
        return kwargs

    def media_inputs(self, model, sample) -> dict:
        """input_ids, pixel values and grids by kind, and `mm_token_type_ids` (batch of 1)."""
        import torch

        kwargs: dict[str, Any] = {"input_ids": sample.input_ids.unsqueeze(0)}
        dtype = next(model.parameters()).dtype
        for kind, pixels_key, grid_key in ((IMAGE, "pixel_values", "image_grid_thw"),
                                           (VIDEO, "pixel_values_videos", "video_grid_thw")):
            chosen = [i for i in sample.items if i.kind == kind]
            if chosen:
                kwargs[pixels_key] = torch.cat([i.pixel_values for i in chosen]).to(dtype)
                kwargs[grid_key] = torch.tensor([list(i.grid_thw) for i in chosen])
        kwargs["mm_token_type_ids"] = mm_token_type_ids(kwargs["input_ids"], model.config.image_token_id,
                                                        model.config.video_token_id)
        return kwargs

    # ---- cost -------------------------------------------------------------------------------------------
    def vision_shape_fields(self, c):
        return dict(hidden_size=int(c.hidden_size), intermediate_size=int(c.intermediate_size), depth=int(c.depth),
                    full_attention_blocks=len(c.fullatt_block_indexes),
                    patch_dim=int(c.in_channels) * int(c.temporal_patch_size) * int(c.patch_size) ** 2,
                    merge_size=int(c.spatial_merge_size),
                    window_merged=int(c.window_size) // int(c.spatial_merge_size) // int(c.patch_size),
                    out_hidden_size=int(c.out_hidden_size))

    # ---- vLLM -------------------------------------------------------------------------------------------
    vllm_weight_prefixes = (
        ("model.language_model.", "language_model.model."),
        ("model.visual.", "visual."),
        ("lm_head.", "language_model.lm_head."),
        ("model.", "language_model.model."),
        ("visual.", "visual."),
    )
    """As vLLM's Qwen2_5_VLForConditionalGeneration maps them when loading (first match wins): the
    in-memory names of transformers >= 4.52, which a sync sends, and the original checkpoint names,
    which `save_pretrained` still writes."""

    def vllm_video_metadata(self, item, geometry):
        """transformers' VideoMetadata of a video whose frames were all sampled at its fps
        (fps = temporal_patch_size / second_per_grid_t: vLLM's mRoPE temporal positions)."""
        frames = item.grid_thw[0] * geometry.temporal_patch_size
        fps = geometry.temporal_patch_size / item.second_per_grid_t
        return {"total_num_frames": frames, "fps": fps, "duration": frames / fps,
                "frames_indices": list(range(frames)),
                "height": item.grid_thw[1] * geometry.patch_size, "width": item.grid_thw[2] * geometry.patch_size}


class Qwen2_VL(Qwen2_5_VL):
    model_type = "qwen2_vl"
    display_name = "Qwen2-VL"
    hf_class = "Qwen2VLForConditionalGeneration"

    def vision_call_inputs(self, visual, grids):
        """Those of `Qwen2VisionTransformerPretrainedModel.forward` (no windows)."""
        return vision_sequence_inputs(visual, grids)


def vision_sequence_inputs(visual, grids) -> dict:
    """A Qwen vision tower's rotary position ids, per-frame bounds (`cu_seqlens`) and their longest
    (`max_seqlen`: only under a flash-type attention, as the tower computes it), by transformers'
    `vision_utils` from host `grids`."""
    from transformers.vision_utils import get_vision_attention_seqlens, get_vision_position_ids

    cu_seqlens, max_seqlen = get_vision_attention_seqlens(grids, visual.config)
    inputs = {"position_ids": get_vision_position_ids(grids, visual.spatial_merge_size),
              "cu_seqlens": cu_seqlens, "max_seqlen": max_seqlen}
    return {key: value for key, value in inputs.items() if value is not None}


QWEN2_5_VL = Qwen2_5_VL()
QWEN2_VL = Qwen2_VL()
