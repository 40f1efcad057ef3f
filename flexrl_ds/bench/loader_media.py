"""Small real-media datasets for ShadowLoader tests and `flexrl bench loader`.

`write_media_dataset(out_dir, ...)` writes PNG images, H.264 MP4 videos (torchcodec's encoder) and
`train.jsonl` in the docs/DATA_FORMAT.md layout. Content is seeded noise over moving gradients, so
decoding does real work and every frame differs. `flexrl make-dataset` (the data subsystem's
generator, following the workload profiles) is the richer tool; this one exists so loader tests
do not depend on it and can make a few tiny files quickly.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class MediaDatasetSpec:
    """What `write_media_dataset` generates."""

    num_videos: int = 4
    """Video records (one `<video>` each)."""
    num_images: int = 2
    """Image records (one `<image>` each)."""
    video_seconds: float = 4.0
    """Length of each video."""
    video_fps: int = 8
    """Frame rate of the encoded videos."""
    video_hw: tuple[int, int] = (112, 140)
    """(height, width) of video frames."""
    image_hw: tuple[int, int] = (84, 112)
    """(height, width) of images."""
    num_bad: int = 0
    """Extra records whose media file is missing (bad records for policy tests)."""
    num_corrupt_frames: int = 0
    """Extra video records (after the good videos, before the images) whose frame data is zeroed
    after encoding, header intact: the probe succeeds, decoding fails (ids `corrupt-NNNN`)."""
    seed: int = 0
    """Content seed."""


def _frames(rng: np.random.Generator, num_frames: int, height: int, width: int):
    import torch

    ys = np.linspace(0, 255, height)[:, None]
    xs = np.linspace(0, 255, width)[None, :]
    frames = np.empty((num_frames, 3, height, width), dtype=np.uint8)
    for index in range(num_frames):
        base = (ys + xs + 9 * index) % 256
        noise = rng.integers(0, 40, size=(3, height, width))
        frames[index] = np.clip(base[None] * np.array([1.0, 0.7, 0.4])[:, None, None] + noise, 0, 255)
    return torch.from_numpy(frames)


def write_media_dataset(out_dir: str | Path, spec: MediaDatasetSpec | None = None) -> Path:
    """Write the media and `train.jsonl` under `out_dir`; returns the JSONL path."""
    from PIL import Image
    from torchcodec.encoders import VideoEncoder

    spec = spec or MediaDatasetSpec()
    out_dir = Path(out_dir)
    (out_dir / "vid").mkdir(parents=True, exist_ok=True)
    (out_dir / "img").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    rows = []
    for index in range(spec.num_videos):
        frames = _frames(rng, int(spec.video_seconds * spec.video_fps), *spec.video_hw)
        name = f"vid/{index:04d}.mp4"
        VideoEncoder(frames, frame_rate=spec.video_fps).to_file(out_dir / name, codec="libx264", crf=23)
        rows.append({"id": f"video-{index:04d}", "prompt": "<video>\nWhat happens?", "images": [],
                     "videos": [name], "answer": "A", "data_source": "synthetic"})
    for index in range(spec.num_corrupt_frames):
        frames = _frames(rng, int(spec.video_seconds * spec.video_fps), *spec.video_hw)
        name = f"vid/corrupt-{index:04d}.mp4"
        VideoEncoder(frames, frame_rate=spec.video_fps).to_file(out_dir / name, codec="libx264", crf=23)
        corrupt_frame_data(out_dir / name)
        rows.append({"id": f"corrupt-{index:04d}", "prompt": "<video>\nWhat happens?", "images": [],
                     "videos": [name], "answer": "D", "data_source": "synthetic"})
    for index in range(spec.num_images):
        (pixels,) = _frames(rng, 1, *spec.image_hw)
        name = f"img/{index:04d}.png"
        Image.fromarray(pixels.permute(1, 2, 0).numpy()).save(out_dir / name)
        rows.append({"id": f"image-{index:04d}", "prompt": "<image>\nWhat is shown?", "images": [name],
                     "videos": [], "answer": "B", "data_source": "synthetic"})
    for index in range(spec.num_bad):
        rows.append({"id": f"missing-{index:04d}", "prompt": "<image>\nBroken.", "images": [f"img/missing-{index}.png"],
                     "videos": [], "answer": "C", "data_source": "synthetic"})
    path = out_dir / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def corrupt_frame_data(path: str | Path) -> None:
    """Zero the payload of an MP4's `mdat` box in place, leaving the container header (`moov`)
    intact: metadata probing still succeeds, every frame fails to decode."""
    path = Path(path)
    data = bytearray(path.read_bytes())
    at = data.find(b"mdat")
    if at < 4:
        raise ValueError(f"{path}: no mdat box")
    size = int.from_bytes(data[at - 4 : at], "big")
    if size < 8 or at - 4 + size > len(data):
        raise ValueError(f"{path}: mdat box size {size} is not a plain 32-bit size")
    data[at + 4 : at - 4 + size] = bytes(size - 8)
    path.write_bytes(bytes(data))
