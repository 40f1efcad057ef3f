"""Qwen3-VL dense (`qwen3_vl`), as transformers 5.25 implements it (models/qwen3_vl/).

- Media: images through `Qwen2VLImageProcessor` at patch 16 (factor 32); videos through
  `Qwen3VLVideoProcessor`: `linspace(0, n-1, count).round()` frame sampling (count = int(n/fps_src*fps)
  clamped to [min_frames, max_frames] and n, not rounded to temporal patches: an odd count repeats the
  last frame), `smart_resize` budgeting pixels over all frames (t x h x w within [shortest_edge,
  longest_edge]; frames narrower than 32 px scaled up first), with `cap_pixels_per_frame` a per-frame
  limit of `max_video_tokens` tokens; mean and std 0.5.
- Prompts: the chat template's `<|vision_start|><|video_pad|><|vision_end|>` becomes, per temporal
  group, `<{t:.1f} seconds><|vision_start|>` + pads + `<|vision_end|>`, t the mean of the group's first
  and last source-frame times (frame index / source fps; `group_timestamps`): a video's pads are
  several runs.
- Positions (`qwen3_positions` = transformers' `get_rope_index`): every image and every video frame
  group is a (1, h, w) grid at the next free position; the text after it resumes max(h, w)/merge on.
  The rotary interleaves the 3 rows itself (`mrope_interleaved`).
- Tower: per-frame attention (so per-frame units stay exact), and DeepStack: `deepstack_features`
  (one per `deepstack_visual_indexes` entry) travel with the merged rows through the vision exchange
  (concatenated on the hidden axis) and are added to the hidden states of the vision tokens after
  decoder layers 0, 1, ... (`run_decoder`: the text model's `visual_pos_masks` /
  `deepstack_visual_embeds` on this rank's local tokens).
"""

from __future__ import annotations

import math
from flexrl_ds.families.base import DecoderExtras
from flexrl_ds.families.qwen2_5_vl import IMAGE, VIDEO, Qwen2_5_VL, vision_sequence_inputs

HALF = [0.5, 0.5, 0.5]


def linspace_frame_positions(num_frames: int, video_fps: float, target_fps: float, min_frames: int,
                             max_frames: int) -> list[int]:
    """Qwen3-VL's video processor `sample_frames` (fps mode) over the `num_frames` in range."""
    import numpy as np

    count = int(num_frames / video_fps * target_fps)
    count = min(max(count, min_frames), max_frames, num_frames)
    return [int(i) for i in np.linspace(0, num_frames - 1, count).round().astype(int)]


def video_smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                       min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's video `smart_resize`: the pixel budget covers all frames (t x h x w)."""
    if num_frames < temporal_factor:
        raise ValueError(f"video has {num_frames} sampled frame(s); at least {temporal_factor} are needed")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio of {width}x{height} exceeds 200")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        return (max(factor, math.floor(height / beta / factor) * factor),
                max(factor, math.floor(width / beta / factor) * factor))
    if t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        return math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def group_timestamps(frame_indices, source_fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal group: the mean of its first and last frame's time (the last group
    padded with the final frame, as the processor pads it)."""
    indices = list(frame_indices)
    if len(indices) % temporal_patch_size:
        indices += [indices[-1]] * (temporal_patch_size - len(indices) % temporal_patch_size)
    times = [index / source_fps for index in indices]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def vision_runs(items, merge_size: int) -> list[tuple[str, int, int]]:
    """(kind, merged rows, merged cols) of every pad run, in prompt order: an image is one run, a
    video one per temporal group."""
    runs = []
    for item in items:
        t, h, w = (int(v) for v in item.grid_thw)
        if item.kind == IMAGE and t != 1:
            raise ValueError(f"image with grid {tuple(item.grid_thw)}: an image has one temporal group")
        runs += [(item.kind, h // merge_size, w // merge_size)] * t
    return runs


def qwen3_positions(input_ids_L, items, image_token_id: int, video_token_id: int, merge_size: int):
    """(3, L) positions of one whole sequence by Qwen3-VL's rope index (module docstring)."""
    import torch

    ids = input_ids_L.tolist()
    pad_ids = {IMAGE: image_token_id, VIDEO: video_token_id}
    chunks, next_position, cursor = [], 0, 0
    for index, (kind, rows, cols) in enumerate(vision_runs(items, merge_size)):
        count = rows * cols
        start = next((i for i in range(cursor, len(ids)) if ids[i] in pad_ids.values()), None)
        if count < 1 or start is None or ids[start:start + count] != [pad_ids[kind]] * count \
                or (start + count < len(ids) and ids[start + count] == pad_ids[kind]):
            raise ValueError(f"vision run {index} ({kind}, {rows}x{cols} merged): expected a run of exactly "
                             f"{count} pad tokens {pad_ids[kind]} as the next vision tokens after token {cursor}")
        chunks.append(torch.arange(start - cursor).expand(3, -1) + next_position)
        first = next_position + start - cursor
        grid_h, grid_w = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
        chunks.append(torch.stack([torch.zeros(count, dtype=torch.long), grid_h.flatten(), grid_w.flatten()]) + first)
        next_position, cursor = first + max(rows, cols), start + count
    left = [i for i in range(cursor, len(ids)) if ids[i] in pad_ids.values()]
    if left:
        raise ValueError(f"{len(left)} vision pad tokens after the last vision item (first at token {left[0]})")
    chunks.append(torch.arange(len(ids) - cursor).expand(3, -1) + next_position)
    return torch.cat(chunks, dim=1).to(torch.long)


class Qwen3_VL(Qwen2_5_VL):
    """Qwen3-VL dense: what differs from Qwen2.5-VL (module docstring)."""

    model_type = "qwen3_vl"
    display_name = "Qwen3-VL"
    hf_class = "Qwen3VLForConditionalGeneration"
    processor_classes = ("Qwen3VLProcessor",)
    video_processor_types = ("Qwen3VLVideoProcessor",)
    processor_defaults = dict(Qwen2_5_VL.processor_defaults)
    """Images: `Qwen2VLImageProcessor`'s class attributes (patch 14, CLIP mean/std: saved Qwen3-VL
    processors set patch 16 and 0.5 in their files)."""
    video_processor_defaults = dict(processor_defaults, patch_size=16, image_mean=HALF, image_std=HALF,
                                    min_frames=4, max_frames=768, max_video_tokens=768)
    video_size_default = {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}
    vision_start, vision_end = "<|vision_start|>", "<|vision_end|>"
    video_budget_over_frames = True
    prompt_timestamps = True

    def video_frame_positions(self, num_frames, video_fps, target_fps, min_frames, max_frames, temporal_patch_size):
        positions = linspace_frame_positions(num_frames, video_fps, target_fps, min_frames, max_frames)
        if len(positions) < temporal_patch_size:
            raise ValueError(f"video has {num_frames} frame(s) in range; at least {temporal_patch_size} are needed")
        return positions

    def video_frame_size(self, height, width, num_sampled, config, max_pixels):
        """`video_max_total_tokens` is the processor's `max_video_tokens` under `cap_pixels_per_frame`:
        here a per-frame token limit."""
        if config.video_max_total_tokens is not None:
            per_frame = max(min(config.video_max_total_tokens * config.factor ** 2, max_pixels // num_sampled),
                            int(config.video_min_pixels * 1.05))
            max_pixels = per_frame * num_sampled
        return video_smart_resize(num_sampled, height, width, config.temporal_patch_size, config.factor,
                                  config.video_min_pixels, max_pixels)

    def group_timestamps(self, item, temporal_patch_size):
        if item.kind != VIDEO:
            return None
        if not item.frame_indices or not item.source_fps:
            raise ValueError("a Qwen3-VL video needs its source frame indices and fps (the prompt's timestamps)")
        return group_timestamps(item.frame_indices, item.source_fps, temporal_patch_size)

    def expand_pads(self, record_id, text, items, merge_size, temporal_patch_size=2):
        """As the HF processor: each video's rendered wrapper collapses to its pad, which becomes the
        frame groups with their timestamps."""
        wrapper = self.vision_start + self.pad_tokens[VIDEO] + self.vision_end
        return super().expand_pads(record_id, text.replace(wrapper, self.pad_tokens[VIDEO]), items, merge_size,
                                   temporal_patch_size)

    def item_text(self, item, pad, merge_size, temporal_patch_size=2):
        if item.kind != VIDEO:
            return super().item_text(item, pad, merge_size, temporal_patch_size)
        t, h, w = item.grid_thw
        stamps = self.group_timestamps(item, temporal_patch_size)
        assert len(stamps) == t, (stamps, item.grid_thw)
        frame = self.vision_start + pad * (h * w // merge_size ** 2) + self.vision_end
        return "".join(f"<{stamp:.1f} seconds>" + frame for stamp in stamps)

    def sequence_positions(self, config, input_ids_L, items):
        return qwen3_positions(input_ids_L, items, int(config.image_token_id), int(config.video_token_id),
                               int(config.vision_config.spatial_merge_size))

    def encode_vision(self, visual, pixels, grids, inputs=None):
        import torch

        out = visual(pixels, grid_thw=grids, **(inputs or {}))
        extras = torch.cat(list(out.deepstack_features), dim=-1) if out.deepstack_features else None
        return out.pooler_output, extras

    def vision_call_inputs(self, visual, grids):
        """Those of `Qwen3VLVisionModel.forward`: the learned position table's interpolation taps and
        weights, and `vision_sequence_inputs`."""
        # lazy: transformers is imported where a model is
        from transformers.vision_utils import get_vision_interpolation_indices_and_weights

        interp_indices, interp_weights = get_vision_interpolation_indices_and_weights(
            grids, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
            align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.config.spatial_merge_size)
        return {"interp_indices": interp_indices, "interp_weights": interp_weights,
                **vision_sequence_inputs(visual, grids)}

    def num_extra_features(self, config):
        return len(config.vision_config.deepstack_visual_indexes)

    def run_decoder(self, hf_model, embeds_1LH, position_ids, extras: DecoderExtras | None, **kwargs):
        deepstack = {} if extras is None else {"visual_pos_masks": extras.vision_mask,
                                               "deepstack_visual_embeds": extras.features}
        return hf_model.model.language_model(inputs_embeds=embeds_1LH, position_ids=position_ids, use_cache=False,
                                             **deepstack, **kwargs)

    def reference_inputs(self, model, sample):
        """Pixels, grids and `mm_token_type_ids`: HF computes its own rope index (what positions equal)."""
        return self.media_inputs(model, sample)

    def vision_shape_fields(self, c):
        merge = int(c.spatial_merge_size)
        return dict(hidden_size=int(c.hidden_size), intermediate_size=int(c.intermediate_size), depth=int(c.depth),
                    full_attention_blocks=int(c.depth),
                    patch_dim=int(c.in_channels) * int(c.temporal_patch_size) * int(c.patch_size) ** 2,
                    merge_size=merge, window_merged=1, out_hidden_size=int(c.out_hidden_size),
                    num_mergers=1 + len(c.deepstack_visual_indexes))

    def vllm_video_metadata(self, item, geometry):
        """The source fps and the sampled frames' source indices (padded to whole temporal groups as
        the frames given are): vLLM's Qwen3-VL builds the same timestamps from them."""
        frames = item.grid_thw[0] * geometry.temporal_patch_size
        indices = list(item.frame_indices) + [item.frame_indices[-1]] * (frames - len(item.frame_indices))
        return {"total_num_frames": frames, "fps": float(item.source_fps), "duration": frames / item.source_fps,
                "frames_indices": indices,
                "height": item.grid_thw[1] * geometry.patch_size, "width": item.grid_thw[2] * geometry.patch_size}


QWEN3_VL = Qwen3_VL()
