"""The ShadowLoader data contract: records, probed metadata, bad records.

Flow: `records.read_dataset(path)` gives `Record`s (validated rows) and `BadRecord`s;
`SamplePreprocessor.probe(record)` turns a record into a `SampleMeta` (metadata only: sizes, frame
counts, the exact frames to sample, predicted grids, vision tokens and tensor shapes) or a
`BadRecord`; `SamplePreprocessor.materialize(meta)` decodes and returns tensors whose shapes are
exactly `meta.predicted_shapes()`. All classes are frozen dataclasses: cheap to pickle for Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flexrl_ds.media.placeholders import IMAGE_KEY, VIDEO_KEY, TensorPlaceholder

IMAGE = "image"
VIDEO = "video"


@dataclass(frozen=True)
class MediaItem:
    """One `<image>` or `<video>` of a record, with its per-item options."""

    kind: str
    """`image` or `video`."""
    path: str
    """Resolved absolute path of the media file (after the dataset's path rules)."""
    source: str = ""
    """The path as written in the record (for messages)."""
    fps: float | None = None
    """Video: frames sampled per second; None: the config's `video_fps`."""
    max_frames: int | None = None
    """Video: most frames sampled; None: the config's `video_max_frames`."""
    start: float | None = None
    """Video: clip start in seconds; None: the beginning."""
    end: float | None = None
    """Video: clip end in seconds (exclusive); None: the end of the video."""
    max_pixels: int | None = None
    """Lowers the config's max pixels (per image, or per frame of a video) for this item."""


@dataclass(frozen=True)
class Record:
    """One validated dataset row (docs/DATA_FORMAT.md)."""

    id: str
    """Unique record id."""
    prompt: str
    """Prompt text with `<image>`/`<video>` markers placing the media, in order."""
    items: tuple[MediaItem, ...]
    """Media in marker order (images and videos interleaved as the markers are)."""
    answer: str | None = None
    """Ground truth for the rule-based reward."""
    data_source: str | None = None
    """Selects the reward function."""
    response: str | None = None
    """Text to score (log-prob tools)."""
    index: int = 0
    """Row number in the dataset file (0-based)."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """Other fields of the row, kept for the caller."""


@dataclass(frozen=True)
class MediaInfo:
    """What probing learned about a media file, without decoding pixels."""

    width: int
    height: int
    num_frames: int = 1
    """Video: frames in the stream (exact count from the container index); image: 1."""
    fps: float | None = None
    """Video: average frames per second."""
    duration: float | None = None
    """Video: seconds."""


@dataclass(frozen=True)
class ItemMeta:
    """Probed metadata and predicted geometry of one media item."""

    item: MediaItem
    info: MediaInfo
    resized_hw: tuple[int, int]
    """(height, width) every frame is resized to (multiples of patch_size * merge_size)."""
    grid_thw: tuple[int, int, int]
    """(temporal groups, patch rows, patch columns); images have 1 temporal group."""
    frame_indices: tuple[int, ...] = ()
    """Video: the exact frame indices (in the file) decoded, in order; images: ()."""
    second_per_grid_t: float | None = None
    """Video: seconds per temporal group (Qwen2.5-VL's `second_per_grid_ts` entry); images: None."""
    patch_dim: int = 1176
    """Floats per pixel row: 3 * temporal_patch_size * patch_size**2."""
    merge_size: int = 2
    temporal_patch_size: int = 2

    @property
    def kind(self) -> str:
        return self.item.kind

    @property
    def num_patches(self) -> int:
        grid_t, grid_h, grid_w = self.grid_thw
        return grid_t * grid_h * grid_w

    @property
    def vision_tokens(self) -> int:
        """LLM tokens of this item after the spatial merge."""
        return self.num_patches // (self.merge_size**2)

    @property
    def num_frames(self) -> int:
        """Frames the vision tower sees (images: 1; videos: the sampled frames)."""
        return len(self.frame_indices) if self.kind == VIDEO else 1

    @property
    def key(self) -> str:
        return VIDEO_KEY if self.kind == VIDEO else IMAGE_KEY


@dataclass(frozen=True)
class SampleMeta:
    """Everything the controller and planner need about a sample, without pixels."""

    id: str
    """Sample id: the record id, or `<bad id>-><substitute id>` for a replacement (policy replace)."""
    record: Record
    """The record the pixels and text come from."""
    items: tuple[ItemMeta, ...]
    """Media in marker order."""

    @property
    def vision_tokens(self) -> int:
        """Total merged vision tokens the sample puts into the LLM sequence."""
        return sum(item.vision_tokens for item in self.items)

    @property
    def num_images(self) -> int:
        return sum(1 for item in self.items if item.kind != VIDEO)

    @property
    def num_frames(self) -> int:
        """Sampled video frames over all videos."""
        return sum(item.num_frames for item in self.items if item.kind == VIDEO)

    def item_placeholder(self, item_index: int, dtype: str = "float32") -> TensorPlaceholder:
        """Placeholder of one whole item's pixel rows."""
        item = self.items[item_index]
        return TensorPlaceholder(
            sample_id=self.id, key=item.key, item_index=item_index, item_grid_thw=item.grid_thw,
            patch_dim=item.patch_dim, temporal_patch_size=item.temporal_patch_size,
            merge_size=item.merge_size, dtype=dtype,
        )

    def placeholders(self, dtype: str = "float32") -> list[TensorPlaceholder]:
        """One placeholder per item, in marker order."""
        return [self.item_placeholder(index, dtype) for index in range(len(self.items))]

    def predicted_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shapes of the HF processor's outputs for this sample: `pixel_values` (N, D) and
        `image_grid_thw` (images, 3) when it has images, `pixel_values_videos`/`video_grid_thw`
        when it has videos. Materialisation (`collate_item_tensors`) yields exactly these."""
        shapes: dict[str, tuple[int, ...]] = {}
        for key, grid_key, kind_is_video in ((IMAGE_KEY, "image_grid_thw", False),
                                             (VIDEO_KEY, "video_grid_thw", True)):
            chosen = [item for item in self.items if (item.kind == VIDEO) == kind_is_video]
            if chosen:
                shapes[key] = (sum(item.num_patches for item in chosen), chosen[0].patch_dim)
                shapes[grid_key] = (len(chosen), 3)
        return shapes

    def workload_entry(self, text_tokens: int) -> dict[str, Any]:
        """This sample as a planner workload sequence (docs/PLAN_SCHEMA.md): `tokens` = the given text
        tokens (prompt text + response) + vision tokens."""
        return {"id": self.id, "tokens": text_tokens + self.vision_tokens, "vision_tokens": self.vision_tokens,
                "images": self.num_images, "frames": self.num_frames}

    def to_json(self) -> dict[str, Any]:
        """Summary for reports and `flexrl inspect-data` (not a full serialisation)."""
        return {
            "id": self.id,
            "vision_tokens": self.vision_tokens,
            "predicted_shapes": {key: list(shape) for key, shape in self.predicted_shapes().items()},
            "items": [
                {"kind": item.kind, "path": item.item.source or item.item.path,
                 "size": [item.info.height, item.info.width], "resized": list(item.resized_hw),
                 "grid_thw": list(item.grid_thw), "vision_tokens": item.vision_tokens,
                 "num_frames": item.num_frames}
                for item in self.items
            ],
        }


@dataclass(frozen=True)
class BadRecord:
    """A record that cannot be trained on, with the reason (never raised: reported and counted)."""

    id: str
    """Record id (or `line N` / `row N` when the row has no usable id)."""
    reason: str
    """Human-readable cause, naming the field or file."""
    index: int = -1
    """Row number in the dataset file, -1 if unknown."""
    stage: str = "probe"
    """Where it was found: read (row validation) | probe (metadata) | materialize (decoding)."""


class BadMediaError(ValueError):
    """Raised by materialisation when a media file fails to decode; carries the `BadRecord`."""

    def __init__(self, bad: BadRecord):
        super().__init__(f"record {bad.id!r}: {bad.reason}")
        self.bad = bad
