"""Shape prediction rules against transformers' own Qwen2-VL functions."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from flexrl_ds.media.config import MediaConfig
from flexrl_ds.media.types import MediaInfo, MediaItem
from flexrl_ds.media.vision_geometry import (
    clip_frame_range,
    fit_to_patch_grid,
    plan_image,
    plan_video,
    sample_frame_positions,
)


@settings(max_examples=200, deadline=None)
@given(height=st.integers(1, 4000), width=st.integers(1, 4000),
       min_tokens=st.integers(1, 300), extra_tokens=st.integers(0, 3000))
def test_fit_to_patch_grid_equals_hf_smart_resize(height, width, min_tokens, extra_tokens):
    min_pixels, max_pixels = min_tokens * 28 * 28, (min_tokens + extra_tokens) * 28 * 28
    try:
        expected = smart_resize(height, width, factor=28, min_pixels=min_pixels, max_pixels=max_pixels)
    except ValueError:
        with pytest.raises(ValueError):
            fit_to_patch_grid(height, width, 28, min_pixels, max_pixels)
        return
    assert fit_to_patch_grid(height, width, 28, min_pixels, max_pixels) == expected


@settings(max_examples=200, deadline=None)
@given(total=st.integers(1, 3000), video_fps=st.sampled_from([1.0, 5.0, 6.0, 8.0, 12.5, 23.976, 24.0, 29.97, 30.0, 60.0]),
       fps=st.sampled_from([0.5, 1.0, 2.0, 3.0, 4.5]), min_frames=st.integers(1, 8),
       max_frames=st.integers(1, 800))
def test_frame_sampling_equals_hf_sample_frames(hf_video_functions, total, video_fps, fps, min_frames, max_frames):
    try:
        expected = hf_video_functions.sample_frames(total, video_fps, fps=fps, min_frames=min_frames,
                                                    max_frames=max_frames, temporal_patch_size=2)
    except (ValueError, ZeroDivisionError):
        with pytest.raises(ValueError):
            sample_frame_positions(total, video_fps, fps, min_frames, max_frames, 2)
        return
    # HF's float32 arange sometimes adds a position equal to `total` (past the end: its own decode
    # then fails); that one is dropped, all others must match.
    assert sample_frame_positions(total, video_fps, fps, min_frames, max_frames, 2) == [
        index for index in expected if index < total]


def test_frame_sampling_never_leaves_the_video():
    for total in range(2, 400):
        for video_fps in (5.0, 8.0, 29.97):
            positions = sample_frame_positions(total, video_fps, 2.0, 4, 768, 2)
            assert 0 <= min(positions) and max(positions) < total
            assert positions == sorted(positions)


def test_clip_range_selects_frames_by_timestamp():
    assert clip_frame_range(100, 10.0, None, None) == (0, 100)
    assert clip_frame_range(100, 10.0, 1.0, 2.5) == (10, 25)
    assert clip_frame_range(100, 10.0, 1.05, 200.0) == (11, 100)
    assert clip_frame_range(100, 10.0, 50.0, None) == (100, 100)


def test_plan_video_clip_offsets_indices_and_counts_tokens():
    config = MediaConfig(video_min_pixels=28 * 28 * 4, video_max_pixels=28 * 28 * 16)
    info = MediaInfo(width=128, height=96, num_frames=240, fps=24.0, duration=10.0)
    whole = plan_video(MediaItem("video", "v.mp4"), info, config)
    clip = plan_video(MediaItem("video", "v.mp4", start=2.0, end=6.0, fps=1.0), info, config)
    assert len(whole.frame_indices) == 20 and whole.frame_indices[0] == 0
    assert clip.frame_indices[0] == 48 and all(48 <= index < 144 for index in clip.frame_indices)
    assert len(clip.frame_indices) == 4  # 4 s at 1 fps, min_frames 4
    grid_t, grid_h, grid_w = clip.grid_thw
    assert grid_t == 2 and clip.vision_tokens == grid_t * grid_h * grid_w // 4
    assert clip.second_per_grid_t == pytest.approx(2.0)


def test_plan_image_respects_per_item_max_pixels():
    config = MediaConfig(image_min_pixels=28 * 28, image_max_pixels=28 * 28 * 1000)
    info = MediaInfo(width=800, height=600)
    free = plan_image(MediaItem("image", "a.png"), info, config)
    capped = plan_image(MediaItem("image", "a.png", max_pixels=28 * 28 * 50), info, config)
    assert free.resized_hw == (588, 812)
    assert capped.resized_hw[0] * capped.resized_hw[1] <= 28 * 28 * 50
    assert capped.grid_thw == (1, capped.resized_hw[0] // 14, capped.resized_hw[1] // 14)


def test_total_token_cap_shrinks_frames_like_hf():
    config = MediaConfig(video_min_pixels=28 * 28 * 4, video_max_pixels=28 * 28 * 256, video_max_total_tokens=200)
    info = MediaInfo(width=640, height=480, num_frames=300, fps=10.0)
    meta = plan_video(MediaItem("video", "v.mp4"), info, config)
    frames = len(meta.frame_indices)
    budget = max(min(28 * 28 * 256, int(200 * 28 * 28 * 0.9) * 2 // frames), int(28 * 28 * 4 * 1.05))
    assert meta.resized_hw == smart_resize(480, 640, 28, 28 * 28 * 4, budget)
