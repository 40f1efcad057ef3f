"""Exact vision geometry from metadata alone, by the rules of the model's family (flexrl_ds/families/:
Qwen2-VL / Qwen2.5-VL's `fit_to_patch_grid` and `sample_frame_positions`, Qwen3-VL's linspace
sampling and whole-video pixel budget).

Given an image's size, or a video's frame count and fps, these functions give the frames that will
be sampled, the size every frame is resized to and the patch grid - the same numbers the Hugging
Face Qwen2-VL image/video processors arrive at (transformers 5.x `smart_resize`, the video
processor's fps `sample_frames` and `cap_pixels_per_frame`). `plan_item` combines them into an
`ItemMeta`. No pixels are touched; torch is used only for `arange`, to reproduce its float32
stepping exactly.
"""

from __future__ import annotations

import math

from flexrl_ds.families import family_for
from flexrl_ds.families.qwen2_5_vl import MAX_ASPECT_RATIO, fit_to_patch_grid, sample_frame_positions
from flexrl_ds.media.config import MediaConfig
from flexrl_ds.media.types import VIDEO, ItemMeta, MediaInfo, MediaItem

__all__ = ["MAX_ASPECT_RATIO", "clip_frame_range", "fit_to_patch_grid", "plan_image", "plan_item", "plan_video",
           "sample_frame_positions"]


def clip_frame_range(num_frames: int, video_fps: float, start: float | None, end: float | None) -> tuple[int, int]:
    """Frames [first, stop) whose timestamps i/fps lie in [start, end) seconds."""
    first = 0 if start is None else min(num_frames, math.ceil(round(start * video_fps, 6)))
    stop = num_frames if end is None else min(num_frames, math.ceil(round(end * video_fps, 6)))
    return first, stop


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
    family = family_for(config.processor_family)
    positions = family.video_frame_positions(
        stop - first, info.fps, item.fps or config.video_fps, config.video_min_frames,
        item.max_frames or config.video_max_frames, config.temporal_patch_size,
    )
    frame_indices = tuple(first + position for position in positions)
    max_pixels = min(config.video_max_pixels, item.max_pixels or config.video_max_pixels)
    resized = family.video_frame_size(info.height, info.width, len(frame_indices), config, max_pixels)
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
