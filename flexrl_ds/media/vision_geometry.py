"""Exact Qwen2-VL / Qwen2.5-VL vision geometry from metadata alone.

Given an image's size, or a video's frame count and fps, these functions give the frames that will
be sampled, the size every frame is resized to and the patch grid - the same numbers the Hugging
Face Qwen2-VL image/video processors arrive at (transformers 5.x `smart_resize`, the video
processor's fps `sample_frames` and `cap_pixels_per_frame`). `plan_item` combines them into an
`ItemMeta`. No pixels are touched; torch is used only for `arange`, to reproduce its float32
stepping exactly.
"""

from __future__ import annotations

import math

import torch

from flexrl_ds.media.config import MediaConfig
from flexrl_ds.media.types import VIDEO, ItemMeta, MediaInfo, MediaItem

MAX_ASPECT_RATIO = 200


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


def clip_frame_range(num_frames: int, video_fps: float, start: float | None, end: float | None) -> tuple[int, int]:
    """Frames [first, stop) whose timestamps i/fps lie in [start, end) seconds."""
    first = 0 if start is None else min(num_frames, math.ceil(round(start * video_fps, 6)))
    stop = num_frames if end is None else min(num_frames, math.ceil(round(end * video_fps, 6)))
    return first, stop


def sample_frame_positions(num_frames: int, video_fps: float, target_fps: float, min_frames: int,
                           max_frames: int, temporal_patch_size: int) -> list[int]:
    """Positions (0-based, within the `num_frames` given) sampled at `target_fps`: the count is
    clamped to [min_frames, max_frames] and to the frames present, then rounded down to whole
    temporal patches; positions are spread evenly (HF Qwen2-VL video processor, fps mode).

    HF computes the positions as `arange(0, n, n / count)` in float32; for many (n, count) pairs
    (e.g. 185 frames, count 46) rounding adds one more position, equal to n, past the last frame,
    where HF's own decoding then fails. That position is dropped here; every other position, and
    the extra one when it lands on n - 1, is kept exactly as HF has it."""
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


def plan_image(item: MediaItem, info: MediaInfo, config: MediaConfig) -> ItemMeta:
    """Geometry of one image."""
    max_pixels = min(config.image_max_pixels, item.max_pixels or config.image_max_pixels)
    resized = fit_to_patch_grid(info.height, info.width, config.factor, config.image_min_pixels, max_pixels)
    grid = (1, resized[0] // config.patch_size, resized[1] // config.patch_size)
    return _item_meta(item, info, resized, grid, config)


def plan_video(item: MediaItem, info: MediaInfo, config: MediaConfig) -> ItemMeta:
    """Geometry of one video: the exact frames decoded, their resized size and the grid."""
    if info.num_frames <= 0:
        raise ValueError("video has no frames")
    if not info.fps or info.fps <= 0:
        raise ValueError("video has no frame rate in its metadata")
    first, stop = clip_frame_range(info.num_frames, info.fps, item.start, item.end)
    if stop <= first:
        raise ValueError(f"clip [{item.start}, {item.end}) s holds no frames of a "
                         f"{info.num_frames / info.fps:.2f} s video")
    positions = sample_frame_positions(
        stop - first, info.fps, item.fps or config.video_fps, config.video_min_frames,
        item.max_frames or config.video_max_frames, config.temporal_patch_size,
    )
    frame_indices = tuple(first + position for position in positions)
    max_pixels = min(config.video_max_pixels, item.max_pixels or config.video_max_pixels)
    if config.video_max_total_tokens is not None:
        total_pixels = int(config.video_max_total_tokens * config.factor * config.factor * 0.9)
        max_pixels = max(min(max_pixels, total_pixels * config.temporal_patch_size // len(frame_indices)),
                         int(config.video_min_pixels * 1.05))
    resized = fit_to_patch_grid(info.height, info.width, config.factor, config.video_min_pixels, max_pixels)
    num_groups = -(-len(frame_indices) // config.temporal_patch_size)
    grid = (num_groups, resized[0] // config.patch_size, resized[1] // config.patch_size)
    sampled_fps = len(frame_indices) / (stop - first) * info.fps
    return _item_meta(item, info, resized, grid, config, frame_indices,
                      config.temporal_patch_size / sampled_fps)


def plan_item(item: MediaItem, info: MediaInfo, config: MediaConfig) -> ItemMeta:
    """`plan_video` or `plan_image` by the item's kind."""
    return plan_video(item, info, config) if item.kind == VIDEO else plan_image(item, info, config)


def _item_meta(item: MediaItem, info: MediaInfo, resized: tuple[int, int], grid: tuple[int, int, int],
               config: MediaConfig, frame_indices: tuple[int, ...] = (),
               second_per_grid_t: float | None = None) -> ItemMeta:
    return ItemMeta(
        item=item, info=info, resized_hw=resized, grid_thw=grid, frame_indices=frame_indices,
        second_per_grid_t=second_per_grid_t,
        patch_dim=3 * config.temporal_patch_size * config.patch_size**2,
        merge_size=config.merge_size, temporal_patch_size=config.temporal_patch_size,
    )
