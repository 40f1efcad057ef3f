"""Writing generated clips as MP4: with torchcodec's encoder, or, where torchcodec cannot load (the GPU
machine has neither torchcodec nor FFmpeg's libraries, only OpenCV with its own FFmpeg), as MPEG-4 part 2
with OpenCV. Datasets, tests and benchmarks make their media through `encode_video`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def encode_video(path: str | Path, frames_NCHW: torch.Tensor, fps: float, **torchcodec_options: Any) -> None:
    """Write uint8 RGB frames (N, 3, H, W) to `path` at `fps`; `torchcodec_options` go to torchcodec's
    `VideoEncoder.to_file` (e.g. codec, pixel_format, extra_options) and are unused by the OpenCV path."""
    try:
        from torchcodec.encoders import VideoEncoder
    except Exception:  # ImportError, or RuntimeError when FFmpeg's libraries are missing
        _encode_video_opencv(path, frames_NCHW, fps)
        return
    VideoEncoder(frames_NCHW, frame_rate=fps).to_file(str(path), **torchcodec_options)


def _encode_video_opencv(path: str | Path, frames_NCHW: torch.Tensor, fps: float) -> None:
    import cv2

    height, width = frames_NCHW.shape[-2:]
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))  # type: ignore[attr-defined]
    try:
        for frame in frames_NCHW.permute(0, 2, 3, 1).numpy():
            writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    finally:
        writer.release()
