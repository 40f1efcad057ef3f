"""Media generated once per session for the data-layer tests, and Hugging Face references.

`media` writes images of odd sizes and several modes, H.264 videos of several sizes / frame counts
/ frame rates, and broken files (truncated, zero-frame, garbage) into a temporary folder.
`hf_video_functions` gives transformers' own Qwen2-VL video `sample_frames` and `patchify`, taken
from the installed transformers source: the video processor class cannot be constructed without
torchvision (absent here), but these two functions only need torch and math.
"""

from __future__ import annotations

import ast
import math
import types
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

IMAGE_SIZES = [(213, 317), (28, 28), (1000, 37), (57, 999), (300, 300), (15, 20), (449, 601), (97, 131)]
# (width, height, frames, fps)
VIDEO_SPECS = [(64, 48, 37, 6), (130, 90, 25, 10), (96, 54, 60, 24), (50, 38, 9, 5), (160, 90, 16, 8),
               (72, 128, 41, 12.5)]


@dataclass
class Media:
    folder: Path
    images: list[Path] = field(default_factory=list)
    videos: list[Path] = field(default_factory=list)
    bad: dict[str, Path] = field(default_factory=dict)


@pytest.fixture(scope="session")
def media(tmp_path_factory) -> Media:
    from PIL import Image

    from flexrl_ds.bench.datasets import video_frames, write_video

    folder = tmp_path_factory.mktemp("media")
    found = Media(folder)
    rng = np.random.default_rng(0)
    for index, (height, width) in enumerate(IMAGE_SIZES):
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        pixels[: height // 2] //= 3  # some structure, not only noise
        image = Image.fromarray(pixels)
        kind = index % 4
        if kind == 1:
            path = folder / f"img{index}.jpg"
            image.save(path, quality=85)
        elif kind == 2:
            path = folder / f"img{index}_rgba.png"
            alpha = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8))
            image.putalpha(alpha)
            image.save(path)
        elif kind == 3:
            path = folder / f"img{index}_gray.png"
            image.convert("L").save(path)
        else:
            path = folder / f"img{index}.png"
            image.save(path)
        found.images.append(path)
    for index, (width, height, num_frames, fps) in enumerate(VIDEO_SPECS):
        path = folder / f"vid{index}.mp4"
        write_video(path, num_frames, width, height, fps, seed=index)
        found.videos.append(path)
    _write_bad_media(found, video_frames)
    return found


def _write_bad_media(found: Media, video_frames) -> None:
    import cv2

    from flexrl_ds.bench.datasets import write_video

    folder = found.folder
    data = found.videos[0].read_bytes()
    (folder / "cut.mp4").write_bytes(data[: len(data) // 2])  # index (moov) at the end: lost
    try:
        from torchcodec.encoders import VideoEncoder

        VideoEncoder(video_frames(30, 64, 48), frame_rate=8).to_file(
            str(folder / "faststart.mp4"), extra_options={"movflags": "+faststart"})
        data = (folder / "faststart.mp4").read_bytes()
        (folder / "faststart_cut.mp4").write_bytes(data[: len(data) // 2])  # index intact, frames lost
    except Exception:  # no torchcodec here: the tests that need this file skip
        pass
    writer = cv2.VideoWriter(str(folder / "zero.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), 8, (64, 48))
    writer.release()
    write_video(folder / "one.mp4", 1, 64, 48, 8)
    (folder / "garbage.png").write_bytes(b"not an image at all")
    png = found.images[0].read_bytes()
    (folder / "cut.png").write_bytes(png[: len(png) // 2])
    found.bad = {name: folder / f"{name}" for name in
                 ("cut.mp4", "faststart_cut.mp4", "zero.mp4", "one.mp4", "garbage.png", "cut.png")}


def _extract_method(source: str, class_name: str, method: str, namespace: dict):
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    item.decorator_list = []
                    module = ast.Module(body=[item], type_ignores=[])
                    exec(compile(module, f"<transformers {class_name}.{method}>", "exec"), namespace)
                    return namespace[method]
    raise LookupError(f"{class_name}.{method} not found")


def _class_defaults(source: str, class_name: str) -> dict:
    defaults = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.Assign) and len(item.targets) == 1 and isinstance(item.targets[0], ast.Name):
                    try:
                        defaults[item.targets[0].id] = ast.literal_eval(item.value)
                    except ValueError:
                        pass
    return defaults


@pytest.fixture(scope="session")
def hf_video_functions():
    """transformers' Qwen2VLVideoProcessor.sample_frames / .patchify as plain callables."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    path = Path(spec.origin).parent / "models" / "qwen2_vl" / "video_processing_qwen2_vl.py"
    source = path.read_text()
    namespace = {"math": math, "torch": torch, "VideoMetadata": object}
    try:
        sample_frames = _extract_method(source, "Qwen2VLVideoProcessor", "sample_frames", dict(namespace))
        patchify = _extract_method(source, "Qwen2VLVideoProcessor", "patchify", dict(namespace))
    except LookupError as error:
        pytest.skip(f"transformers layout changed: {error}")
    defaults = {"num_frames": None, "fps": None, **_class_defaults(source, "Qwen2VLVideoProcessor")}
    holder = types.SimpleNamespace(**defaults)

    def hf_sample_frames(total_num_frames: int, video_fps: float, **kwargs) -> list[int]:
        metadata = types.SimpleNamespace(total_num_frames=total_num_frames, fps=video_fps)
        return hf_sample_frames_raw(metadata, **kwargs)

    def hf_sample_frames_raw(metadata, **kwargs):
        return sample_frames(holder, metadata, **kwargs).tolist()

    def hf_patchify(videos_BNCHW: torch.Tensor, patch_size=14, merge_size=2, temporal_patch_size=2):
        return patchify(holder, videos_BNCHW, patch_size=patch_size, merge_size=merge_size,
                        temporal_patch_size=temporal_patch_size)

    return types.SimpleNamespace(sample_frames=hf_sample_frames, patchify=hf_patchify, defaults=defaults)
