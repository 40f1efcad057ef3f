"""Typed media settings of the ShadowLoader data layer (section `flexrl.data` of a run config,
without its `loader` and `pool` parts: those belong to the loader, `flexrl_ds/loader/config.py`,
whose `DataConfig` adds them to `MediaConfig`).

Defaults follow the Hugging Face Qwen2-VL / Qwen2.5-VL image and video processors, so that the
shapes predicted from metadata and the tensors produced here equal what the model's processor makes.
`MediaConfig.with_processor_dir(model_dir)` reads a saved processor's JSON files (no transformers
import) and overrides the pixel settings with the model's own values, strictly: a setting the
ShadowLoader cannot reproduce is a ValueError naming the file and key (`processor_files.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, TypeVar

from flexrl_ds.common.typed import from_dict
from flexrl_ds.families import REGISTRY
from flexrl_ds.media.processor_files import processor_settings

OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]

VIDEO_BACKENDS = ("auto", "torchcodec", "opencv")
"""Accepted `video_backend` names: "auto" + the keys of `video_backends.VIDEO_BACKENDS` (the registry;
a test keeps the two equal, so that loading a config never imports torch)."""
RESIZE_IMPLS = ("auto", "pil", "torch")
TRANSPARENCY_MODES = ("auto", "white", "drop")
"""`image_io.load_image_rgb` transparency handling (kept equal to ("auto",) + image_io.TRANSPARENCY_POLICIES)."""
BAD_RECORD_POLICIES = ("skip", "replace", "error")
"""The one list of bad-record policies (semantics: `flexrl_ds/media/bad_records.py`)."""


_Media = TypeVar("_Media", bound="MediaConfig")
"""A MediaConfig or a class deriving from it (`DataConfig`): what `with_processor_dir` returns."""


@dataclass
class MediaConfig:
    """Media settings of `flexrl.data`: pixel geometry, decoding, bad-record policy. The section's
    loader and pool parts are added by `loader.config.DataConfig`, a subclass."""

    image_min_pixels: int = 56 * 56
    """Smallest pixel count an image is resized to (HF image processor `size.shortest_edge`)."""
    image_max_pixels: int = 28 * 28 * 1280
    """Largest pixel count of a resized image (`size.longest_edge`); a record's `max_pixels` lowers it."""
    video_min_pixels: int = 128 * 28 * 28
    """Smallest pixel count of a resized video frame (HF video processor `size.shortest_edge`)."""
    video_max_pixels: int = 28 * 28 * 768
    """Largest pixel count of a resized video frame (`size.longest_edge`); per-record `max_pixels` lowers it."""
    video_fps: float = 2.0
    """Frames sampled per second of video; a record's `fps` overrides it."""
    video_min_frames: int = 4
    """Fewest frames sampled from a video (HF `min_frames`), if the video has that many."""
    video_max_frames: int = 768
    """Most frames sampled from a video (HF `max_frames`); a record's `max_frames` overrides it."""
    video_max_total_tokens: int | None = None
    """If set, HF's `cap_pixels_per_frame`: frames of long videos shrink so the whole video stays
    within 90% of this many tokens' pixels (HF `max_video_tokens`). None: no total cap (HF default)."""
    patch_size: int = 14
    """Vision transformer patch side in pixels."""
    merge_size: int = 2
    """Spatial merge of patches into one LLM token (2x2 for Qwen2.5-VL)."""
    temporal_patch_size: int = 2
    """Frames per temporal patch; an image is repeated to fill it."""
    image_mean: list[float] = field(default_factory=lambda: list(OPENAI_CLIP_MEAN))
    """Per-channel normalisation mean (after scaling to [0, 1])."""
    image_std: list[float] = field(default_factory=lambda: list(OPENAI_CLIP_STD))
    """Per-channel normalisation standard deviation."""
    rescale_factor: float = 1 / 255
    """uint8 pixel values are multiplied by this before normalising (HF `rescale_factor`; 1.0 for a
    processor saved with `do_rescale: false`)."""
    do_normalize: bool = True
    """Standardise per channel with image_mean / image_std after rescaling (HF `do_normalize`)."""
    transparency: str = "auto"
    """Images with transparency (alpha band or transparent colour): white (composited onto white) |
    drop (alpha ignored, PIL `convert("RGB")`) | auto (what the installed transformers' image
    processors do: 5.24 composites onto white, 5.17/5.18 drop)."""
    video_backend: str = "auto"
    """Video decoder: torchcodec | opencv | auto (torchcodec if importable, else OpenCV)."""
    decoder_threads: int = 1
    """FFmpeg threads per torchcodec decode (0: FFmpeg decides); 1 suits many actors per node."""
    resize_impl: str = "auto"
    """Resize kernel: pil (HF PIL backend) | torch (HF torchvision backend: antialiased bicubic on
    tensors) | auto (what transformers picks here: torch if torchvision is importable, else pil).
    Videos always use torch, as HF's video processor does."""
    processor_family: str = "qwen2_5_vl"
    """Whose processor rules the geometry follows (a `model_type` of flexrl_ds/families/: qwen2_5_vl,
    qwen3_vl, ...); set from the model's files by `with_processor_dir`."""
    media_root: str | None = None
    """Folder under which absolute media paths are accepted; None: absolute paths are rejected."""
    bad_record_policy: str = "skip"
    """What happens to a bad record, in the training loader and the offline tools alike:
    skip (dropped, reported) | replace (a good record reserved from the end of the epoch's order
    stands in, reported) | error (stop with the record id and reason). Semantics:
    `flexrl_ds/media/bad_records.py`."""
    max_vision_tokens_per_sample: int | None = None
    """A sample whose predicted vision tokens exceed this is a bad record ("oversized"); None: no cap."""
    verify_images: bool = True
    """While probing, check image files for corruption (PIL verify: reads, does not decode pixels)."""

    def __post_init__(self) -> None:
        for name in ("image_min_pixels", "image_max_pixels", "video_min_pixels", "video_max_pixels",
                     "video_min_frames", "video_max_frames", "patch_size", "merge_size",
                     "temporal_patch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"flexrl.data.{name}: must be positive, got {getattr(self, name)}")
        if self.image_min_pixels > self.image_max_pixels:
            raise ValueError("flexrl.data.image_min_pixels exceeds flexrl.data.image_max_pixels")
        if self.video_min_pixels > self.video_max_pixels:
            raise ValueError("flexrl.data.video_min_pixels exceeds flexrl.data.video_max_pixels")
        if self.decoder_threads < 0:
            raise ValueError(f"flexrl.data.decoder_threads: must be >= 0, got {self.decoder_threads}")
        if self.video_fps <= 0:
            raise ValueError(f"flexrl.data.video_fps: must be positive, got {self.video_fps}")
        _check_choice("processor_family", self.processor_family, tuple(REGISTRY))
        _check_choice("video_backend", self.video_backend, VIDEO_BACKENDS)
        _check_choice("resize_impl", self.resize_impl, RESIZE_IMPLS)
        _check_choice("bad_record_policy", self.bad_record_policy, BAD_RECORD_POLICIES)
        _check_choice("transparency", self.transparency, TRANSPARENCY_MODES)
        if not (math.isfinite(self.rescale_factor) and self.rescale_factor > 0):
            raise ValueError(f"flexrl.data.rescale_factor: must be a positive number, got {self.rescale_factor}")
        for name in ("image_mean", "image_std"):
            if len(getattr(self, name)) != 3:
                raise ValueError(f"flexrl.data.{name}: needs 3 values (RGB), got {getattr(self, name)}")
        for name in ("video_max_total_tokens", "max_vision_tokens_per_sample"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"flexrl.data.{name}: must be positive, got {value}")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (patch_size * merge_size = 28 for Qwen2.5-VL)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "flexrl.data") -> MediaConfig:
        """Validated construction from the JSON `flexrl.data` object."""
        return from_dict(cls, raw, where=where)

    def with_processor_dir(self: _Media, model_dir: str | Path) -> _Media:
        """This config with the pixel settings of a saved HF processor (processor_config.json,
        preprocessor_config.json, video_preprocessor_config.json, found as transformers 5.x finds
        them): sizes, patch/merge/temporal patch, mean/std, rescale factor, normalisation, frame
        sampling. A key the files leave out takes the Qwen2-VL processor class default; the other
        fields (policy, transparency, ...; a `DataConfig`'s loader and pool) are kept, and so is the
        class. Settings ShadowLoader cannot reproduce
        (another resample, no RGB conversion, ...) raise a ValueError naming the file and key;
        the full list of honoured, checked and ignored keys: `flexrl_ds/media/processor_files.py`."""
        try:
            return replace(self, **processor_settings(model_dir))
        except ValueError as error:
            if str(error).startswith("flexrl.data."):  # the combination fails MediaConfig's own checks
                raise ValueError(f"{model_dir}: processor settings give {error}") from None
            raise


def replaced_by_processor(config: MediaConfig, resolved: MediaConfig, model_dir: str | Path) -> list[str]:
    """Lines naming the pixel settings set in `config` (away from the class defaults) that
    `resolved = config.with_processor_dir(model_dir)` holds other values of, from the model's
    processor files."""
    defaults = type(config)()
    lines = []
    for name in (f.name for f in fields(config)):
        mine, value = getattr(config, name), getattr(resolved, name)
        if mine != getattr(defaults, name) and mine != value:
            lines.append(f"flexrl.data.{name} = {mine!r} is replaced by the model's processor setting {value!r} "
                         f"({model_dir}): the engines and the trainer see the pixels the model's processor "
                         "makes; change them in its processor files")
    return lines


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"flexrl.data.{name}: {value!r} is not one of {', '.join(allowed)}")
