"""Writing generated clips as MP4, frames handed over in chunks (a long 720p clip never sits in memory
whole): with torchcodec's streaming encoder, or, where torchcodec cannot load (the GPU machine has
neither torchcodec nor FFmpeg's libraries, only OpenCV with its own FFmpeg: ../shared/device/README.md),
as MPEG-4 part 2 ('mp4v', which every OpenCV build writes) with OpenCV. Both video backends
(media/video_backends.py) read either. Datasets, tests and benchmarks make their media through here."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch


def encode_video(path: str | Path, frames_NCHW: torch.Tensor, fps: float, **torchcodec_options: Any) -> None:
    """Write uint8 RGB frames (N, 3, H, W) to `path` at `fps` (`encode_video_chunks` of one chunk)."""
    height, width = frames_NCHW.shape[-2:]
    encode_video_chunks(path, [frames_NCHW], int(width), int(height), fps, **torchcodec_options)


def encode_video_chunks(path: str | Path, chunks: Iterable[torch.Tensor], width: int, height: int, fps: float,
                        **torchcodec_options: Any) -> None:
    """Write uint8 RGB frame chunks (n, 3, height, width), in order, to `path` at `fps`;
    `torchcodec_options` go to torchcodec's `Encoder.add_video` (codec, pixel_format, preset,
    extra_options) and are unused by the OpenCV path."""
    try:
        from torchcodec.encoders import Encoder
    except Exception:  # ImportError, or RuntimeError when FFmpeg's libraries are missing
        _encode_opencv(path, chunks, width, height, fps)
        return
    encoder = Encoder()
    stream = encoder.add_video(height=height, width=width, frame_rate=fps, device="cpu", **torchcodec_options)
    with encoder.open_file(str(path)):
        for frames in chunks:
            stream.add_frames(frames)


def _encode_opencv(path: str | Path, chunks: Iterable[torch.Tensor], width: int, height: int, fps: float) -> None:
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (width, height))  # type: ignore[attr-defined]
    if not writer.isOpened():  # else every write would be dropped without a word
        raise RuntimeError(f"{path}: OpenCV cannot write MPEG-4 video here (its build has no FFmpeg writer), "
                           "and torchcodec cannot load")
    try:
        for frames in chunks:
            for frame in frames.permute(0, 2, 3, 1).numpy():
                writer.write(cv2.cvtColor(frame, cv2.COLOR_RGB2BGR))
    finally:
        writer.release()
