"""`SamplePreprocessor`: metadata probing and materialisation of one sample (plain class, no Ray).

- `probe(record)` -> `SampleMeta` or `BadRecord`: opens media headers only (PIL for images, the
  video backend's container metadata for videos) and predicts everything: sampled frame indices,
  resized sizes, grids, vision tokens, tensor shapes.
- `materialize(meta)` -> `{item_index: ItemTensors}`: decode, sample, resize, normalise, patchify -
  the tensors of the Hugging Face Qwen2-VL/Qwen2.5-VL processor, of exactly the predicted shapes.
- `materialize_item(meta, k, groups=(i, j))` / `materialize_slice(meta, placeholder)`: one item, or
  only temporal groups i..j of a video (decoding only their frames) - the unit a Ray preprocessing
  actor caches and a worker's Materializer fetches.
- `collate(meta, tensors)`: the HF processor's keyed outputs (`pixel_values`, `image_grid_thw`,
  `pixel_values_videos`, `video_grid_thw`, `second_per_grid_ts`).

Decoding failures raise `BadMediaError` carrying a `BadRecord` (stage "materialize"); the caller
applies the bad-record policy.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from flexrl_ds.media import image_io
from flexrl_ds.media.config import MediaConfig
from flexrl_ds.media.placeholders import IMAGE_KEY, VIDEO_KEY, TensorPlaceholder
from flexrl_ds.media.types import VIDEO, BadMediaError, BadRecord, ItemMeta, MediaInfo, MediaItem, Record, SampleMeta
from flexrl_ds.media.video_backends import VideoBackend, get_video_backend
from flexrl_ds.media.vision_geometry import plan_item


@dataclass
class ItemTensors:
    """Materialised pixels of one item (or of a run of a video's temporal groups)."""

    pixel_values: torch.Tensor
    """(rows, patch_dim) float32, rows = t*h*w of `grid_thw`."""
    grid_thw: torch.Tensor
    """(3,) int64: temporal groups, patch rows, patch columns of these rows."""


class SamplePreprocessor:
    """Probe and materialise samples for one data config (thread-compatible, holds no files open)."""

    def __init__(self, config: MediaConfig | None = None, video_backend: VideoBackend | None = None):
        self.config = config or MediaConfig()
        self._video_backend = video_backend
        impl = self.config.resize_impl
        self.image_resize_impl = ("torch" if image_io.torchvision_importable() else "pil") if impl == "auto" else impl

    @property
    def video_backend(self) -> VideoBackend:
        if self._video_backend is None:
            self._video_backend = get_video_backend(self.config.video_backend, self.config.decoder_threads)
        return self._video_backend

    # ---- probing ------------------------------------------------------------------------------
    def probe(self, record: Record) -> SampleMeta | BadRecord:
        """Metadata and predicted geometry of every item; the first failing item makes it bad."""
        items = []
        for position, item in enumerate(record.items):
            try:
                items.append(plan_item(item, self.probe_media(item), self.config))
            except ValueError as error:
                name = item.source or item.path
                return BadRecord(record.id, f"{item.kind} {position} ({name}): {error}", record.index, "probe")
        meta = SampleMeta(id=record.id, record=record, items=tuple(items))
        limit = self.config.max_vision_tokens_per_sample
        if limit is not None and meta.vision_tokens > limit:
            return BadRecord(record.id, f"oversized: {meta.vision_tokens} vision tokens exceed "
                             f"max_vision_tokens_per_sample={limit}", record.index, "probe")
        return meta

    def probe_media(self, item: MediaItem) -> MediaInfo:
        """Header metadata of one file; ValueError names the problem (missing, unreadable, empty)."""
        if not os.path.isfile(item.path):
            raise ValueError("missing file")
        if item.kind == VIDEO:
            info = self.video_backend.probe(item.path)
            if info.num_frames <= 0:
                raise ValueError("video has zero frames")
            return info
        return _probe_image(item.path, verify=self.config.verify_images)

    # ---- materialisation ----------------------------------------------------------------------
    def materialize(self, meta: SampleMeta, items: list[int] | None = None) -> dict[int, ItemTensors]:
        """Tensors of the chosen items (all by default), keyed by item index."""
        indices = range(len(meta.items)) if items is None else items
        return {index: self.materialize_item(meta, index) for index in indices}

    def materialize_item(self, meta: SampleMeta, item_index: int,
                         groups: tuple[int, int] | None = None) -> ItemTensors:
        """One item; for a video optionally only temporal groups [start, stop) (decoding only
        their frames). Rows equal the corresponding rows of the whole item's tensor."""
        item = meta.items[item_index]
        start, stop = groups if groups is not None else (0, item.grid_thw[0])
        if not 0 <= start < stop <= item.grid_thw[0]:
            raise ValueError(f"sample {meta.id!r} item {item_index}: groups [{start}, {stop}) outside "
                             f"[0, {item.grid_thw[0]})")
        try:
            frames = self._decode(item, start, stop)
        except ValueError as error:
            name = item.item.source or item.item.path
            bad = BadRecord(meta.record.id, f"{item.kind} {item_index} ({name}): {error}",
                            meta.record.index, "materialize")
            raise BadMediaError(bad) from None
        pixel_values = self._pixels(frames, item)
        grid = (stop - start, item.grid_thw[1], item.grid_thw[2])
        assert pixel_values.shape == (grid[0] * grid[1] * grid[2], item.patch_dim), (pixel_values.shape, grid)
        return ItemTensors(pixel_values=pixel_values, grid_thw=torch.tensor(grid, dtype=torch.long))

    def materialize_slice(self, meta: SampleMeta, placeholder: TensorPlaceholder) -> torch.Tensor:
        """The tensor a placeholder stands for (shape == placeholder.shape)."""
        assert placeholder.sample_id == meta.id, (placeholder.sample_id, meta.id)
        tensors = self.materialize_item(meta, placeholder.item_index, (placeholder.t_start, placeholder.t_stop))
        return tensors.pixel_values.to(getattr(torch, placeholder.dtype))

    def process(self, record: Record) -> tuple[SampleMeta, dict[str, torch.Tensor]] | BadRecord:
        """Probe + materialise + collate one record (for tools and references)."""
        meta = self.probe(record)
        if isinstance(meta, BadRecord):
            return meta
        try:
            return meta, collate(meta, self.materialize(meta))
        except BadMediaError as error:
            return error.bad

    def _decode(self, item: ItemMeta, start: int, stop: int) -> torch.Tensor:
        """uint8 (frames, 3, H, W) of groups [start, stop): a video's frames, or the image once."""
        if item.kind != VIDEO:
            frames = image_io.load_image_rgb(item.item.path, self.config.transparency).unsqueeze(0)
        else:
            size = item.temporal_patch_size
            positions = range(start * size, min(stop * size, len(item.frame_indices)))
            frames = self.video_backend.decode(item.item.path, [item.frame_indices[p] for p in positions])
        if tuple(frames.shape[-2:]) != (item.info.height, item.info.width):
            raise ValueError(f"decoded frames are {frames.shape[-1]}x{frames.shape[-2]}, metadata said "
                             f"{item.info.width}x{item.info.height}")
        return frames

    def _pixels(self, frames: torch.Tensor, item: ItemMeta) -> torch.Tensor:
        config = self.config
        impl = "torch" if item.kind == VIDEO else self.image_resize_impl
        resized = image_io.resize(frames, item.resized_hw, impl)
        normalised = image_io.normalize(resized, config.image_mean, config.image_std, config.rescale_factor,
                                        config.do_normalize)
        return image_io.patchify(normalised, config.patch_size, config.merge_size, config.temporal_patch_size)


def collate(meta: SampleMeta, tensors: dict[int, ItemTensors]) -> dict[str, torch.Tensor | list[float]]:
    """Concatenate whole-item tensors into the HF processor's outputs for this sample."""
    outputs: dict[str, torch.Tensor | list[float]] = {}
    for key, grid_key, want_video in ((IMAGE_KEY, "image_grid_thw", False), (VIDEO_KEY, "video_grid_thw", True)):
        chosen = [index for index, item in enumerate(meta.items) if (item.kind == VIDEO) == want_video]
        if not chosen:
            continue
        outputs[key] = torch.cat([tensors[index].pixel_values for index in chosen])
        outputs[grid_key] = torch.stack([tensors[index].grid_thw for index in chosen])
        if want_video:
            outputs["second_per_grid_ts"] = [meta.items[index].second_per_grid_t for index in chosen]
    return outputs


def _probe_image(path: str, verify: bool) -> MediaInfo:
    from PIL import Image

    try:
        with Image.open(path) as image:
            width, height = image.size
            if verify:
                image.verify()
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise ValueError(f"cannot read image ({error})") from None
    if width <= 0 or height <= 0:
        raise ValueError("image is empty")
    return MediaInfo(width=width, height=height)
