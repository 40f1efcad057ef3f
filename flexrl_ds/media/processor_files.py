"""Read a saved Hugging Face Qwen2-VL processor's JSON files into `MediaConfig` field values (strict).

`processor_settings(model_dir)` finds the image and video processor settings the way transformers 5.x
loads them - the image processor from `processor_config.json["image_processor"]`, else
`preprocessor_config.json`; the video processor from `processor_config.json["video_processor"]`,
else `video_preprocessor_config.json`, else `preprocessor_config.json` - and classifies every key the
Qwen2-VL processors read:

- honoured (returned as `MediaConfig` fields, used by `vision_geometry.py` / `preprocess.py`):
  `size.shortest_edge` / `size.longest_edge` and the top-level `min_pixels` / `max_pixels` that
  override them (as transformers does); `patch_size`, `merge_size`, `temporal_patch_size`;
  `image_mean`, `image_std` (a single number means all three channels); `do_rescale` with
  `rescale_factor` (-> `rescale_factor`, 1.0 when `do_rescale` is false); `do_normalize`; and for
  videos `fps`, `min_frames`, `max_frames`, `cap_pixels_per_frame` with `max_video_tokens`
  (-> `video_max_total_tokens`). A key missing from a file takes the Qwen2-VL processor class
  default, which is the `MediaConfig` default; only `fps` and the total-token cap (arguments of the
  processor call in transformers) keep the config's value when the file does not set them.
- accepted only at the one value ShadowLoader implements, else a ValueError naming the file, key,
  value and what is supported: `do_resize` (true), `resample` (3 = bicubic), `do_convert_rgb`
  (true), `num_frames` (absent or null: frames are sampled by fps), `image_processor_type`
  (Qwen2VLImageProcessor, ...Fast, ...Pil) and `video_processor_type` (Qwen2VLVideoProcessor).
- ignored, because they do not change the pixels or shapes of the Qwen2-VL processors:
  `IGNORED_KEYS` (e.g. `do_center_crop`/`crop_size`, `do_pad`/`pad_size`: the Qwen2-VL processors'
  own `_preprocess` never crops or pads; `do_sample_frames`: ShadowLoader always samples frames at
  `fps` itself, in the role qwen-vl-utils plays for a processor saved with `do_sample_frames=false`).
  Keys transformers' Qwen2-VL processors do not know are ignored as transformers ignores them.

The rules are those of the model's family (flexrl_ds/families/: the directory's config.json
`model_type`, else the saved `processor_class`): its processor classes and their defaults, e.g.
Qwen3-VL's `Qwen3VLVideoProcessor` (patch 16, mean/std 0.5; its sizes bound a whole video's pixels).
The family's name is returned as `processor_family`.

A value that must be honoured and is `null` is rejected: transformers' image backends read a null
differently (the PIL backend as off/None, the torchvision backend as the class default).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flexrl_ds import families
from flexrl_ds.families.qwen2_5_vl import QWEN2_5_VL
IMAGE_FILE = "preprocessor_config.json"
VIDEO_FILE = "video_preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"

SUPPORTED_IMAGE_PROCESSORS = QWEN2_5_VL.image_processor_types
SUPPORTED_VIDEO_PROCESSORS = QWEN2_5_VL.video_processor_types
"""Qwen2.5-VL's; another family's are its module's (`ModelFamily.video_processor_types`)."""
BICUBIC = 3
"""`PIL.Image.Resampling.BICUBIC`, the only `resample` ShadowLoader's resize kernels implement."""

IGNORED_KEYS = frozenset({
    "processor_class", "auto_map", "data_format", "input_data_format", "device", "return_tensors",
    "return_metadata", "video_metadata", "default_to_square", "disable_grouping", "image_seq_length",
    "do_center_crop", "crop_size", "do_pad", "pad_size", "size_divisor", "do_sample_frames",
    "use_token_compression",
})
"""Keys that do not affect the Qwen2-VL processors' pixels or shapes (see the module docstring)."""
COMMON_KEYS = ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std",
               "do_rescale", "rescale_factor", "do_normalize", "do_resize", "resample", "do_convert_rgb")
"""Keys read from both the image and the video settings; the resulting values must agree."""
SIZE_KEYS = ("size", "min_pixels", "max_pixels")
VIDEO_KEYS = ("fps", "min_frames", "max_frames", "num_frames", "cap_pixels_per_frame", "max_video_tokens")
TYPE_KEYS = ("image_processor_type", "video_processor_type")
CLASS_DEFAULTS: dict[str, Any] = QWEN2_5_VL.processor_defaults
"""Qwen2-VL image/video processor class attributes used when a file leaves a key out (another
family's: its `ModelFamily.processor_defaults` / `video_processor_defaults`)."""
IMAGE_SIZE_DEFAULT = QWEN2_5_VL.image_size_default
VIDEO_SIZE_DEFAULT = QWEN2_5_VL.video_size_default


@dataclass(frozen=True)
class ProcessorSettings:
    """One processor's saved settings and where they came from (named in every error)."""

    where: str
    """File (and nested key) the settings were read from, e.g. `.../preprocessor_config.json`."""
    values: dict[str, Any]
    """The JSON object as saved."""
    defaults: dict[str, Any] | None = None
    """The processor class's attributes (None: Qwen2-VL's, `CLASS_DEFAULTS`)."""

    def get(self, key: str) -> Any:
        """The saved value, or the class default when absent; null is rejected."""
        if key not in self.values:
            return (CLASS_DEFAULTS if self.defaults is None else self.defaults).get(key)
        value = self.values[key]
        if value is None:
            raise ValueError(f"{self.where}: {key} is null; transformers' image backends read a null "
                             f"differently (off, or the class default): write the value")
        return value

    def require(self, key: str, supported: Any, what: str) -> None:
        """Reject a value ShadowLoader does not implement."""
        value = self.get(key)
        if value != supported or type(value) is not type(supported):
            raise ValueError(f"{self.where}: {key}={json.dumps(value)} is not supported; "
                             f"ShadowLoader supports {key}={json.dumps(supported)} only ({what})")


def processor_settings(model_dir: str | Path) -> dict[str, Any]:
    """`MediaConfig` field values from the processor files in `model_dir` (see the module docstring)."""
    image, video = find_settings(Path(model_dir))
    family = processor_family(Path(model_dir), image, video)
    image = replace(image, defaults=family.processor_defaults)
    video = replace(video, defaults=family.video_processor_defaults or family.processor_defaults)
    common = _common_fields(image)
    video_common = _common_fields(video)
    for name, value in common.items():
        if video_common[name] != value:
            raise ValueError(f"{video.where}: {name} is {video_common[name]} but {value} in {image.where} "
                             f"(a key left out means the {family.display_name} class default); ShadowLoader "
                             f"applies one "
                             f"value to images and videos")
    for settings in (image, video):
        _check_type(settings, "image_processor_type", family.image_processor_types)
    _check_type(video, "video_processor_type", family.video_processor_types)
    fields = dict(common, processor_family=family.model_type)
    fields["image_min_pixels"], fields["image_max_pixels"] = _pixel_limits(image, family.image_size_default)
    fields["video_min_pixels"], fields["video_max_pixels"] = _pixel_limits(video, family.video_size_default)
    fields.update(_video_fields(video))
    return fields


def processor_family(model_dir: Path, image: ProcessorSettings, video: ProcessorSettings):
    """The family whose processor rules apply: the model's (config.json `model_type`) where the folder
    is a model directory, else the one whose processor class the files name (`processor_class`),
    else Qwen2.5-VL's."""
    if (model_dir / "config.json").is_file():
        family = families.family_of_dir(model_dir)
        if family.has_vision:
            return family
    named = {settings.values.get("processor_class") for settings in (image, video)}
    named.add((_read_json(model_dir / PROCESSOR_FILE) or {}).get("processor_class"))
    for model_type in families.REGISTRY:
        family = families.family_for(model_type)
        if named & set(family.processor_classes):
            return family
    return QWEN2_5_VL


def has_processor_files(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds a saved HF image processor (a text-only model has none)."""
    folder = Path(model_dir)
    return (folder / IMAGE_FILE).exists() or "image_processor" in (_read_json(folder / PROCESSOR_FILE) or {})


def find_settings(model_dir: Path) -> tuple[ProcessorSettings, ProcessorSettings]:
    """(image, video) settings in transformers 5.x's order of precedence."""
    if not Path(model_dir).is_dir():
        what = "not a directory" if Path(model_dir).exists() else "no such directory"
        raise ValueError(f"{model_dir}: {what} (a model or processor directory is needed)")
    nested = _read_json(model_dir / PROCESSOR_FILE) or {}
    image = _nested(model_dir / PROCESSOR_FILE, nested, "image_processor") or _file(model_dir / IMAGE_FILE)
    if image is None:
        raise ValueError(f"{model_dir}: no {IMAGE_FILE} and no 'image_processor' in {PROCESSOR_FILE} "
                         f"(not a saved HF processor)")
    video = (_nested(model_dir / PROCESSOR_FILE, nested, "video_processor") or _file(model_dir / VIDEO_FILE)
             or _file(model_dir / IMAGE_FILE) or image)
    return image, video


def _common_fields(settings: ProcessorSettings) -> dict[str, Any]:
    settings.require("do_resize", True, "every image and frame is resized to a multiple of patch_size * merge_size")
    settings.require("resample", BICUBIC, "bicubic resize")
    settings.require("do_convert_rgb", True, "images are always converted to RGB")
    fields: dict[str, Any] = {name: _positive_int(settings, name)
                              for name in ("patch_size", "merge_size", "temporal_patch_size")}
    for name in ("image_mean", "image_std"):
        fields[name] = _channel_values(settings, name)
    fields["rescale_factor"] = _positive_number(settings, "rescale_factor") if _boolean(settings, "do_rescale") else 1.0
    fields["do_normalize"] = _boolean(settings, "do_normalize")
    return fields


def _pixel_limits(settings: ProcessorSettings, default_size: dict[str, int]) -> tuple[int, int]:
    """transformers' rule: `size` (or the class default), then top-level min/max_pixels override it."""
    size = settings.values.get("size")
    size = dict(default_size) if size is None else size
    if not isinstance(size, dict):
        raise ValueError(f"{settings.where}: size={json.dumps(size)}: expected an object with "
                         f"shortest_edge and longest_edge (minimum and maximum pixel counts)")
    limits = {"shortest_edge": size.get("shortest_edge"), "longest_edge": size.get("longest_edge")}
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if settings.values.get(key) is not None:
            limits[edge] = settings.values[key]
    for edge, value in limits.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{settings.where}: size.{edge}={json.dumps(value)}: expected a positive pixel "
                             f"count (transformers' Qwen2-VL processors need size.shortest_edge and "
                             f"size.longest_edge, or min_pixels and max_pixels)")
    return limits["shortest_edge"], limits["longest_edge"]


def _video_fields(video: ProcessorSettings) -> dict[str, Any]:
    if video.values.get("num_frames") is not None:
        raise ValueError(f"{video.where}: num_frames={json.dumps(video.values['num_frames'])} is not supported; "
                         f"ShadowLoader samples frames by fps only (remove num_frames, set fps)")
    fields: dict[str, Any] = {"video_min_frames": _positive_int(video, "min_frames"),
                              "video_max_frames": _positive_int(video, "max_frames")}
    if video.values.get("fps") is not None:
        fields["video_fps"] = _positive_number(video, "fps")
    cap = video.values.get("cap_pixels_per_frame")
    if cap is not None:
        if not isinstance(cap, bool):
            raise ValueError(f"{video.where}: cap_pixels_per_frame={json.dumps(cap)}: expected true or false")
        fields["video_max_total_tokens"] = _positive_int(video, "max_video_tokens") if cap else None
    return fields


def _check_type(settings: ProcessorSettings, key: str, supported: tuple[str, ...]) -> None:
    value = settings.values.get(key)
    if value is not None and value not in supported:
        raise ValueError(f"{settings.where}: {key}={json.dumps(value)} is not supported; ShadowLoader "
                         f"reproduces {', '.join(supported)}")


def _positive_int(settings: ProcessorSettings, key: str) -> int:
    value = settings.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{settings.where}: {key}={json.dumps(value)}: expected a positive integer")
    return value


def _positive_number(settings: ProcessorSettings, key: str) -> float:
    value = settings.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{settings.where}: {key}={json.dumps(value)}: expected a positive number")
    return float(value)


def _boolean(settings: ProcessorSettings, key: str) -> bool:
    value = settings.get(key)
    if not isinstance(value, bool):
        raise ValueError(f"{settings.where}: {key}={json.dumps(value)}: expected true or false")
    return value


def _channel_values(settings: ProcessorSettings, key: str) -> list[float]:
    value = settings.get(key)
    values = [value] * 3 if isinstance(value, (int, float)) and not isinstance(value, bool) else value
    if not isinstance(values, list) or len(values) != 3 or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{settings.where}: {key}={json.dumps(value)}: expected one number or 3 (RGB)")
    return [float(v) for v in values]


def _file(path: Path) -> ProcessorSettings | None:
    values = _read_json(path)
    return None if values is None else ProcessorSettings(str(path), values)


def _nested(path: Path, processor: dict[str, Any], key: str) -> ProcessorSettings | None:
    values = processor.get(key)
    if values is None:
        return None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: {key}: expected an object, got {type(values).__name__}")
    return ProcessorSettings(f"{path}[{key!r}]", values)


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(values).__name__}")
    return values
