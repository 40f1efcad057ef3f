"""Predicted shapes == materialised shapes on randomly generated media (hypothesis)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexrl_ds.media.config import MediaConfig
from flexrl_ds.media.preprocess import SamplePreprocessor
from flexrl_ds.media.types import BadRecord, MediaItem, Record

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def shapes_of(outputs) -> dict:
    return {key: tuple(value.shape) for key, value in outputs.items() if isinstance(value, torch.Tensor)}


@settings(max_examples=30, **SETTINGS)
@given(height=st.integers(1, 700), width=st.integers(1, 700), min_tokens=st.integers(1, 16),
       extra_tokens=st.integers(0, 200), max_pixels=st.one_of(st.none(), st.integers(28 * 28, 28 * 28 * 100)))
def test_images(tmp_path, height, width, min_tokens, extra_tokens, max_pixels):
    from PIL import Image

    path = tmp_path / f"i{height}x{width}.png"
    Image.fromarray(np.full((height, width, 3), 90, dtype=np.uint8)).save(path)
    config = MediaConfig(image_min_pixels=min_tokens * 784, image_max_pixels=(min_tokens + extra_tokens) * 784)
    record = Record("r", "<image>", (MediaItem("image", str(path), max_pixels=max_pixels),))
    result = SamplePreprocessor(config).process(record)
    if max(height, width) / min(height, width) > 200:
        assert isinstance(result, BadRecord) and "aspect ratio" in result.reason
        return
    meta, outputs = result
    assert shapes_of(outputs) == meta.predicted_shapes()
    assert outputs["image_grid_thw"].tolist() == [list(meta.items[0].grid_thw)]


@pytest.mark.parametrize("backend", ["torchcodec", "opencv"])
@settings(max_examples=10, **SETTINGS)
@given(half_width=st.integers(8, 60), half_height=st.integers(8, 40), num_frames=st.integers(2, 70),
       fps=st.sampled_from([3.0, 7.5, 10.0, 24.0]), target_fps=st.sampled_from([0.5, 2.0, 5.0]),
       max_frames=st.integers(2, 40), clip=st.booleans())
def test_videos(tmp_path, backend, half_width, half_height, num_frames, fps, target_fps, max_frames, clip):
    from flexrl_ds.bench.datasets import write_video
    from flexrl_ds.media.video_backends import available_backends

    if backend not in available_backends():
        pytest.skip(f"{backend} not available")
    path = tmp_path / f"v{half_width}_{half_height}_{num_frames}_{fps}.mp4"
    if not path.exists():
        write_video(path, num_frames, 2 * half_width, 2 * half_height, fps)
    config = MediaConfig(video_min_pixels=784 * 4, video_max_pixels=784 * 20, video_backend=backend)
    duration = num_frames / fps
    options = {"start": duration / 4, "end": duration} if clip else {}
    record = Record("r", "<video>", (MediaItem("video", str(path), fps=target_fps, max_frames=max_frames, **options),))
    result = SamplePreprocessor(config).process(record)
    if isinstance(result, BadRecord):  # too few frames in range for one temporal patch
        assert "at least 2 are needed" in result.reason or "holds no frames" in result.reason
        return
    meta, outputs = result
    assert shapes_of(outputs) == meta.predicted_shapes()
    indices = meta.items[0].frame_indices
    assert len(indices) <= max_frames and all(0 <= i < num_frames for i in indices)
