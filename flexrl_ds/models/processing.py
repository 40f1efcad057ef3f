"""Model inputs of one record for Qwen2.5-VL / Qwen2, without transformers' processor class.

transformers' `Qwen2_5_VLProcessor` cannot be built where torchvision is missing (its video processor
requires it), so this module composes the same pieces: the model directory's tokenizer and chat
template, the Qwen2-VL image processor (PIL backend) for images, and a Qwen2-VL-equivalent patchify for
video frames (`video_patches`). Placeholder expansion follows the processor: each `<|image_pad|>` /
`<|video_pad|>` becomes `t*h*w / merge_size**2` copies.

`load_media` is the one small function that reads media files (PIL for images, torchcodec for video);
swap it for the ShadowLoader's materialised tensors when those are available.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

MARKER = re.compile(r"<(image|video)>")
IMAGE, VIDEO = "image", "video"
TOKEN_TYPE = {IMAGE: 1, VIDEO: 2}
PAD = re.compile(r"(<\|image_pad\|>|<\|video_pad\|>)")
PAD_KIND = {"<|image_pad|>": IMAGE, "<|video_pad|>": VIDEO}


@dataclass
class VisionItem:
    """One image or video after patchify: what the vision tower encodes."""

    kind: str
    """'image' or 'video'."""
    pixel_values: torch.Tensor
    """(t*h*w, 3 * temporal_patch * patch**2) patch rows, Qwen2-VL order."""
    grid_thw: tuple[int, int, int]
    """(temporal groups, patch rows, patch columns)."""
    second_per_grid_t: float = 1.0
    """Seconds per temporal group (videos: temporal_patch_size / sampled fps)."""

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    def num_tokens(self, merge_size: int = 2) -> int:
        """Merged LLM tokens this item becomes."""
        return self.num_patches // (merge_size * merge_size)


@dataclass
class EncodedSample:
    """A record as model inputs: token ids of prompt + response and its vision items."""

    id: str
    input_ids: torch.Tensor
    """(L,) int64: chat-rendered prompt with expanded vision pads, then the response tokens."""
    response_start: int
    """Index of the first response token in `input_ids`."""
    items: list[VisionItem] = field(default_factory=list)
    """Vision items in prompt order (images and videos mixed)."""

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    def of_kind(self, kind: str) -> list[VisionItem]:
        return [item for item in self.items if item.kind == kind]


@dataclass
class RawRecord:
    """A dataset row reduced to what scoring needs (data-format.md field names)."""

    id: str
    prompt: str
    response: str
    images: list[str]
    """Absolute image paths."""
    videos: list[dict[str, Any]]
    """Per video: {'path': absolute path, 'fps': float | None, 'max_frames': int | None}."""


def read_records(path: str | Path) -> list[RawRecord]:
    """Rows of a JSONL file with `id`, `prompt`, `response`, `images`, `videos` (paths relative to it)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: dataset file not found")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [_raw_record(row, index, path.resolve().parent) for index, row in enumerate(rows)]


def _raw_record(row: dict, index: int, folder: Path) -> RawRecord:
    record_id = str(row.get("id", f"row {index}"))
    for key in ("prompt", "response"):
        if not isinstance(row.get(key), str):
            raise ValueError(f"record {record_id!r}: field {key!r} must be a string")
    images = [str(_inside(folder, p, record_id)) for p in row.get("images") or []]
    videos = []
    for entry in row.get("videos") or []:
        entry = {"path": entry} if isinstance(entry, str) else dict(entry)
        videos.append({"path": str(_inside(folder, entry["path"], record_id)),
                       "fps": entry.get("fps", row.get("fps")),
                       "max_frames": entry.get("max_frames", row.get("max_frames"))})
    markers = MARKER.findall(row["prompt"])
    if markers.count(IMAGE) != len(images) or markers.count(VIDEO) != len(videos):
        raise ValueError(f"record {record_id!r}: prompt has {markers.count(IMAGE)} <image> / "
                         f"{markers.count(VIDEO)} <video> markers but {len(images)} images / "
                         f"{len(videos)} videos")
    return RawRecord(record_id, row["prompt"], row["response"], images, videos)


def _inside(folder: Path, relative: str, record_id: str) -> Path:
    resolved = (folder / relative).resolve()
    if folder not in resolved.parents:
        raise ValueError(f"record {record_id!r}: media path {relative!r} escapes the dataset folder")
    return resolved


@dataclass(frozen=True)
class VisionGeometry:
    """Qwen2-VL preprocessing constants (from the model directory's preprocessor_config.json)."""

    min_pixels: int
    max_pixels: int
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, ...] = (0.26862954, 0.26130258, 0.27577711)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "VisionGeometry":
        raw = json.loads((Path(model_dir) / "preprocessor_config.json").read_text())
        size = raw.get("size") or {}
        return cls(min_pixels=int(size.get("shortest_edge", raw.get("min_pixels", 56 * 56))),
                   max_pixels=int(size.get("longest_edge", raw.get("max_pixels", 28 * 28 * 1280))),
                   patch_size=raw.get("patch_size", 14), temporal_patch_size=raw.get("temporal_patch_size", 2),
                   merge_size=raw.get("merge_size", 2), image_mean=tuple(raw["image_mean"]),
                   image_std=tuple(raw["image_std"]))

    def resized(self, height: int, width: int) -> tuple[int, int]:
        """Qwen2-VL smart resize: sides multiples of patch*merge, pixels within [min, max]."""
        factor = self.patch_size * self.merge_size
        h_bar, w_bar = max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)
        if h_bar * w_bar > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h_bar = max(factor, math.floor(height / beta / factor) * factor)
            w_bar = max(factor, math.floor(width / beta / factor) * factor)
        elif h_bar * w_bar < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h_bar, w_bar


def video_patches(frames_TCHW: np.ndarray, geometry: VisionGeometry) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Qwen2-VL patchify of already resized and normalised frames (T, C, H, W) float32.

    Pads T to a multiple of temporal_patch_size by repeating the last frame, then orders rows as
    (group, block row, block col, merge row, merge col) with (C, temporal, patch, patch) per row.
    """
    tp, ps, ms = geometry.temporal_patch_size, geometry.patch_size, geometry.merge_size
    if frames_TCHW.shape[0] % tp:
        pad = tp - frames_TCHW.shape[0] % tp
        frames_TCHW = np.concatenate([frames_TCHW, np.repeat(frames_TCHW[-1:], pad, axis=0)])
    t, c, h, w = frames_TCHW.shape
    grid_t, grid_h, grid_w = t // tp, h // ps, w // ps
    x = frames_TCHW.reshape(grid_t, tp, c, grid_h // ms, ms, ps, grid_w // ms, ms, ps)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    rows = np.ascontiguousarray(x).reshape(grid_t * grid_h * grid_w, c * tp * ps * ps)
    return torch.from_numpy(rows), (grid_t, grid_h, grid_w)


def normalized_frames(frames_THWC: np.ndarray, geometry: VisionGeometry) -> np.ndarray:
    """Resize (PIL bicubic) every uint8 frame to the smart-resize size; rescale and normalise."""
    from PIL import Image

    height, width = frames_THWC.shape[1:3]
    new_h, new_w = geometry.resized(height, width)
    resized = np.stack([np.asarray(Image.fromarray(f).resize((new_w, new_h), Image.BICUBIC)) for f in frames_THWC])
    mean = np.asarray(geometry.image_mean, dtype=np.float32)
    std = np.asarray(geometry.image_std, dtype=np.float32)
    out = (resized.astype(np.float32) / 255.0 - mean) / std
    return out.transpose(0, 3, 1, 2)


def load_media(record: RawRecord) -> list[tuple[str, Any, float]]:
    """Decode a record's media in prompt order: (kind, PIL image | uint8 frames (T,H,W,C), fps)."""
    from PIL import Image

    images, videos = iter(record.images), iter(record.videos)
    out = []
    for kind in MARKER.findall(record.prompt):
        if kind == IMAGE:
            path = next(images)
            try:
                out.append((IMAGE, Image.open(path).convert("RGB"), 0.0))
            except (OSError, ValueError) as error:
                raise ValueError(f"record {record.id!r}: cannot read image {path} ({error})") from None
        else:
            video = next(videos)
            frames, fps = _decode_video(video["path"], video["fps"] or 2.0, video["max_frames"], record.id)
            out.append((VIDEO, frames, fps))
    return out


def _decode_video(path: str, fps: float, max_frames: int | None, record_id: str) -> tuple[np.ndarray, float]:
    """Frames sampled at `fps` (at least 2, at most `max_frames`), as uint8 (T, H, W, C)."""
    from torchcodec.decoders import VideoDecoder

    try:
        decoder = VideoDecoder(path)
        meta = decoder.metadata
        num_frames = meta.num_frames
        native_fps = float(meta.average_fps or fps)
    except Exception as error:  # torchcodec raises RuntimeError/ValueError for unreadable files
        raise ValueError(f"record {record_id!r}: cannot read video {path} ({error})") from None
    duration = num_frames / native_fps
    count = max(2, min(num_frames, int(round(duration * fps))))
    if max_frames:
        count = min(count, int(max_frames))
    indices = np.linspace(0, num_frames - 1, count).round().astype(int).tolist()
    frames = decoder.get_frames_at(indices=indices).data.numpy()  # (T, C, H, W) uint8
    sampled_fps = count / duration if duration > 0 else fps
    return frames.transpose(0, 2, 3, 1), sampled_fps


class SampleEncoder:
    """Turns records into `EncodedSample`s with a model directory's tokenizer and processor files."""

    def __init__(self, model_dir: str | Path):
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.has_vision = (Path(model_dir) / "preprocessor_config.json").exists()
        if self.has_vision:
            self.image_processor = transformers.AutoImageProcessor.from_pretrained(model_dir)
            self.geometry = VisionGeometry.from_model_dir(model_dir)

    def encode(self, record: RawRecord) -> EncodedSample:
        media = load_media(record) if self.has_vision else []
        if media and not self.has_vision:
            raise ValueError(f"record {record.id!r}: has media but the model has no vision tower")
        items = [self._item(kind, data, fps) for kind, data, fps in media]
        return self.encode_items(record.id, record.prompt, record.response, items)

    def encode_items(self, record_id: str, prompt: str, response: str, items: list[VisionItem]) -> EncodedSample:
        parts, pieces = [], MARKER.split(prompt)
        for index, piece in enumerate(pieces):
            if index % 2 == 0:
                if piece:
                    parts.append({"type": "text", "text": piece})
            else:
                parts.append({"type": piece})
        messages = [{"role": "user", "content": parts}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        text = self._expand_pads(record_id, text, items)
        prompt_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        response_ids = self.tokenizer(response, add_special_tokens=False)["input_ids"]
        if not response_ids:
            raise ValueError(f"record {record_id!r}: empty response")
        input_ids = torch.tensor(prompt_ids + response_ids, dtype=torch.long)
        return EncodedSample(record_id, input_ids, len(prompt_ids), items)

    def _expand_pads(self, record_id: str, text: str, items: list[VisionItem]) -> str:
        """Each rendered pad token becomes one pad per merged vision token of its item (in order)."""
        pieces = PAD.split(text)
        pads = pieces[1::2]
        if [PAD_KIND[p] for p in pads] != [item.kind for item in items]:
            raise ValueError(f"record {record_id!r}: rendered prompt has vision pads {pads} but the "
                             f"media items are {[item.kind for item in items]}")
        merge = self.geometry.merge_size if self.has_vision else 2
        out = list(pieces)
        for index, item in enumerate(items):
            out[2 * index + 1] = pads[index] * item.num_tokens(merge)
        return "".join(out)

    def _item(self, kind: str, data, fps: float) -> VisionItem:
        if kind == IMAGE:
            out = self.image_processor(images=[data], return_tensors="pt")
            grid = tuple(int(x) for x in out["image_grid_thw"][0])
            return VisionItem(IMAGE, out["pixel_values"].float(), grid)
        rows, grid = video_patches(normalized_frames(data, self.geometry), self.geometry)
        return VisionItem(VIDEO, rows, grid, self.geometry.temporal_patch_size / fps)
