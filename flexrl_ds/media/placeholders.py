"""Shape-only stand-ins for pixel tensors.

A `TensorPlaceholder` describes the rows of `pixel_values` (images) or `pixel_values_videos`
(videos) that one media item, or a run of a video's temporal patch groups, will produce once
materialised - without any pixel data. The controller and the FlexUlysses planner work on these;
a worker's Materializer later swaps each placeholder for the real tensor of exactly that shape
(`SamplePreprocessor.materialize_slice`).

Layout (Qwen2-VL patchify): an item with grid (t, h, w) gives `t*h*w` rows of
`3 * temporal_patch_size * patch_size**2` floats; the rows of temporal group g are the contiguous
block `[g*h*w, (g+1)*h*w)`, so a run of groups is a contiguous row range. Every `merge_size**2`
consecutive rows merge into one LLM token. An image has t == 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

IMAGE_KEY = "pixel_values"
VIDEO_KEY = "pixel_values_videos"


@dataclass(frozen=True)
class TensorPlaceholder:
    """The pixel rows of one media item, or of temporal groups [t_start, t_stop) of a video."""

    sample_id: str
    """Id of the sample (record) the pixels belong to."""
    key: str
    """`pixel_values` for an image, `pixel_values_videos` for a video (the HF processor's keys)."""
    item_index: int
    """Index of the media item within the sample, in prompt (marker) order, images and videos mixed."""
    item_grid_thw: tuple[int, int, int]
    """Grid (temporal groups, patch rows, patch columns) of the whole item."""
    patch_dim: int
    """Floats per row: 3 * temporal_patch_size * patch_size**2 (1176 for Qwen2.5-VL)."""
    t_start: int = 0
    """First temporal patch group covered (0 for images)."""
    t_stop: int | None = None
    """One past the last temporal group covered; None means the item's last group."""
    temporal_patch_size: int = 2
    """Frames per temporal group (to convert frame ranges into group ranges)."""
    merge_size: int = 2
    """Spatial merge size: merge_size**2 rows form one LLM token."""
    dtype: str = "float32"
    """Element type of the materialised tensor (torch dtype name)."""

    def __post_init__(self) -> None:
        num_groups = self.item_grid_thw[0]
        stop = num_groups if self.t_stop is None else self.t_stop
        assert 0 <= self.t_start < stop <= num_groups, (self.t_start, self.t_stop, self.item_grid_thw)
        object.__setattr__(self, "t_stop", stop)

    # ---- shapes -------------------------------------------------------------------------------
    @property
    def grid_thw(self) -> tuple[int, int, int]:
        """Grid of the covered part: (groups covered, h, w); what `*_grid_thw` holds for it."""
        _, grid_h, grid_w = self.item_grid_thw
        return (self.t_stop - self.t_start, grid_h, grid_w)

    @property
    def rows_per_group(self) -> int:
        return self.item_grid_thw[1] * self.item_grid_thw[2]

    @property
    def num_rows(self) -> int:
        """Patches covered (rows of the materialised tensor); the vision tower's cost unit."""
        return (self.t_stop - self.t_start) * self.rows_per_group

    @property
    def shape(self) -> tuple[int, int]:
        """Exact shape of the materialised tensor."""
        return (self.num_rows, self.patch_dim)

    @property
    def row_range(self) -> tuple[int, int]:
        """Rows [start, stop) of the whole item's tensor that this placeholder covers."""
        return (self.t_start * self.rows_per_group, self.t_stop * self.rows_per_group)

    @property
    def frame_range(self) -> tuple[int, int]:
        """Positions [start, stop) in the item's sampled-frame list covered (videos)."""
        return (self.t_start * self.temporal_patch_size, self.t_stop * self.temporal_patch_size)

    @property
    def vision_tokens(self) -> int:
        """LLM tokens these rows become after the spatial merge."""
        return self.num_rows // (self.merge_size**2)

    @property
    def nbytes(self) -> int:
        itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}[self.dtype]
        return self.num_rows * self.patch_dim * itemsize

    @property
    def is_whole_item(self) -> bool:
        return self.t_start == 0 and self.t_stop == self.item_grid_thw[0]

    # ---- slicing ------------------------------------------------------------------------------
    def slice_groups(self, start: int, stop: int) -> TensorPlaceholder:
        """Temporal groups [start, stop) *relative to this placeholder*."""
        num_groups = self.t_stop - self.t_start
        if not 0 <= start < stop <= num_groups:
            raise ValueError(
                f"sample {self.sample_id!r} item {self.item_index}: group range [{start}, {stop}) "
                f"outside [0, {num_groups})"
            )
        return replace(self, t_start=self.t_start + start, t_stop=self.t_start + stop)

    def slice_frames(self, start: int, stop: int) -> TensorPlaceholder:
        """Sampled frames [start, stop) relative to this placeholder; both ends must fall on
        temporal-group boundaries (the vision tower cannot split a temporal patch)."""
        size = self.temporal_patch_size
        if start % size or stop % size:
            raise ValueError(
                f"sample {self.sample_id!r} item {self.item_index}: frame range [{start}, {stop}) "
                f"does not fall on temporal groups of {size} frames"
            )
        return self.slice_groups(start // size, stop // size)

    def split_groups(self, num_groups_per_part: list[int]) -> list[TensorPlaceholder]:
        """Consecutive pieces holding the given numbers of temporal groups (must sum to all)."""
        if sum(num_groups_per_part) != self.t_stop - self.t_start or min(num_groups_per_part) <= 0:
            raise ValueError(
                f"sample {self.sample_id!r} item {self.item_index}: parts {num_groups_per_part} do "
                f"not cover its {self.t_stop - self.t_start} temporal groups"
            )
        pieces, start = [], 0
        for count in num_groups_per_part:
            pieces.append(self.slice_groups(start, start + count))
            start += count
        return pieces

    def to_json(self) -> dict:
        return {
            "sample_id": self.sample_id, "key": self.key, "item_index": self.item_index,
            "item_grid_thw": list(self.item_grid_thw), "patch_dim": self.patch_dim,
            "t_start": self.t_start, "t_stop": self.t_stop,
            "temporal_patch_size": self.temporal_patch_size, "merge_size": self.merge_size,
            "dtype": self.dtype, "shape": list(self.shape),
        }
