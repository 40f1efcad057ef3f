"""Seeded synthetic GRPO workloads shaped like the FlexRL paper's data mixes.

Three profiles model Geo3K images, NExTQA short videos and LongVILA-Reason long videos; a mix
samples profiles by weight. A step of `B` prompts with `n` samples gives `B·n` sequences; samples
of one prompt share prompt and vision tokens and differ in response length.

Token arithmetic follows Qwen2.5-VL (kept in small functions below, independent of the exact
HF-processor port in flexrl_ds/data/): a frame or image is resized to multiples of 28 px within
[min_pixels, max_pixels] and gives one LLM token per 28×28 block (14-px patches merged 2×2);
videos give one token per block per *two* frames (temporal patch 2). Each image or video is wrapped
in two marker tokens (vision start / end). Pure module: numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from flexrl_ds.planning.plan import SequenceSpec, Workload

BLOCK_PX = 28
"""Side of one merged vision token in pixels (patch 14 × merge 2)."""
TEMPORAL_PATCH = 2
"""Frames per temporal patch for videos."""
MARKER_TOKENS = 2
"""<|vision_start|> and <|vision_end|> around each image or video."""
FPS = 2.0
"""Frame sampling rate for videos."""

MIXES: dict[str, tuple[float, float, float]] = {
    "image-heavy": (5, 2, 1),
    "video-heavy": (1, 2, 5),
    "only-video": (0, 1, 1),
}
"""Mix name -> sampling weights (image, short_video, long_video)."""
PROFILES = ("image", "short_video", "long_video")


def smart_resize(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2.5-VL resize rule: round each side to a multiple of 28, then rescale into the pixel range."""
    h_bar = max(BLOCK_PX, round(height / BLOCK_PX) * BLOCK_PX)
    w_bar = max(BLOCK_PX, round(width / BLOCK_PX) * BLOCK_PX)
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(BLOCK_PX, math.floor(height / beta / BLOCK_PX) * BLOCK_PX)
        w_bar = max(BLOCK_PX, math.floor(width / beta / BLOCK_PX) * BLOCK_PX)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / BLOCK_PX) * BLOCK_PX
        w_bar = math.ceil(width * beta / BLOCK_PX) * BLOCK_PX
    return h_bar, w_bar


def image_tokens(height: int, width: int, min_pixels: int, max_pixels: int) -> int:
    """Merged LLM tokens of one image (one per 28×28 block after resizing)."""
    h_bar, w_bar = smart_resize(height, width, min_pixels, max_pixels)
    return (h_bar // BLOCK_PX) * (w_bar // BLOCK_PX)


def video_frames(duration_s: float, min_frames: int, max_frames: int) -> int:
    """Frames sampled at FPS, clamped to [min, max], rounded down to a multiple of the temporal patch."""
    frames = min(max(round(duration_s * FPS), min_frames), max_frames)
    return max(TEMPORAL_PATCH, frames // TEMPORAL_PATCH * TEMPORAL_PATCH)


def video_tokens(frames: int, height: int, width: int, max_pixels: int, min_pixels: int = 4 * 28 * 28) -> int:
    """Merged LLM tokens of a video: blocks per frame × frames / temporal patch."""
    return image_tokens(height, width, min_pixels, max_pixels) * (frames // TEMPORAL_PATCH)


@dataclass(frozen=True)
class Prompt:
    """What the samples of one prompt share."""

    profile: str
    prompt_tokens: int
    vision_tokens: int
    images: int
    frames: int
    response_range: tuple[int, int]


def _image_prompt(rng: np.random.Generator) -> Prompt:
    num_images = 2 if rng.random() < 0.1 else 1
    vision = 0
    for _ in range(num_images):
        height, width = (int(v) for v in rng.integers(200, 1001, size=2))
        vision += image_tokens(height, width, 4 * 28 * 28, 1024 * 28 * 28) + MARKER_TOKENS
    return Prompt("image", int(rng.integers(50, 251)), vision, num_images, 0, (64, 1024))


def _short_video_prompt(rng: np.random.Generator) -> Prompt:
    # Log-normal durations clipped to 10–120 s; median 38 s, mean ≈ 44 s like NExTQA.
    duration = float(np.clip(rng.lognormal(math.log(38.0), 0.55), 10.0, 120.0))
    frames = video_frames(duration, 16, 64)
    width = int(rng.integers(320, 641))
    height = width * 3 // 4
    vision = video_tokens(frames, height, width, 360 * 420) + MARKER_TOKENS
    return Prompt("short_video", int(rng.integers(30, 151)), vision, 0, frames, (32, 1024))


_LONG_VIDEO_SIZES = ((360, 640), (480, 854), (720, 1280), (1080, 1920))


def _long_video_prompt(rng: np.random.Generator) -> Prompt:
    duration = float(rng.uniform(60.0, 600.0))
    frames = video_frames(duration, 128, 512)
    height, width = _LONG_VIDEO_SIZES[int(rng.integers(len(_LONG_VIDEO_SIZES)))]
    vision = video_tokens(frames, height, width, 448 * 252) + MARKER_TOKENS
    return Prompt("long_video", int(rng.integers(60, 301)), vision, 0, frames, (256, 1024))


_MAKERS = {"image": _image_prompt, "short_video": _short_video_prompt, "long_video": _long_video_prompt}


def make_workload(mix: str, num_sequences: int, seed: int, n_samples: int = 8) -> Workload:
    """`num_sequences` sequences from ceil(num/n) prompts of `mix`, n samples each (last one cut)."""
    if mix not in MIXES:
        raise ValueError(f"--mix {mix!r}: unknown mix; choose one of {', '.join(MIXES)}")
    if num_sequences < 1:
        raise ValueError(f"--num must be >= 1, got {num_sequences}")
    if n_samples < 1:
        raise ValueError(f"--n-samples must be >= 1, got {n_samples}")
    rng = np.random.default_rng(seed)
    weights = np.asarray(MIXES[mix], dtype=float)
    weights /= weights.sum()
    num_prompts = -(-num_sequences // n_samples)
    sequences: list[SequenceSpec] = []
    for prompt_index in range(num_prompts):
        profile = PROFILES[int(rng.choice(len(PROFILES), p=weights))]
        prompt = _MAKERS[profile](rng)
        low, high = prompt.response_range
        for sample in range(min(n_samples, num_sequences - len(sequences))):
            response = int(rng.integers(low, high + 1))
            sequences.append(SequenceSpec(
                id=f"{profile[0]}{prompt_index}-{sample}",
                tokens=prompt.prompt_tokens + prompt.vision_tokens + response,
                vision_tokens=prompt.vision_tokens, images=prompt.images, frames=prompt.frames,
            ))
    return Workload(tuple(sequences))


def make_step(mix: str, global_batch: int, n_samples: int, seed: int) -> Workload:
    """One GRPO step: `global_batch` prompts × `n_samples` samples."""
    if global_batch < 1:
        raise ValueError(f"--gbs must be >= 1, got {global_batch}")
    return make_workload(mix, global_batch * n_samples, seed, n_samples)


def uniform_workload(num_sequences: int, tokens: int) -> Workload:
    """All sequences of the same length (e.g. for the zero-all-to-all check)."""
    return Workload(tuple(SequenceSpec(id=f"u{i}", tokens=tokens) for i in range(num_sequences)))
