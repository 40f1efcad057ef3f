"""TensorPlaceholder: shape-only slicing by images, frames and temporal groups."""

from __future__ import annotations

import pickle

import pytest

from flexrl_ds.media.placeholders import TensorPlaceholder
from flexrl_ds.media.types import ItemMeta, MediaInfo, MediaItem, Record, SampleMeta


def video_placeholder(groups=6, h=4, w=6) -> TensorPlaceholder:
    return TensorPlaceholder(sample_id="s", key="pixel_values_videos", item_index=1,
                             item_grid_thw=(groups, h, w), patch_dim=1176)


def test_whole_item_shape_and_tokens():
    placeholder = video_placeholder()
    assert placeholder.shape == (6 * 4 * 6, 1176) and placeholder.is_whole_item
    assert placeholder.vision_tokens == 36 and placeholder.nbytes == 144 * 1176 * 4
    assert placeholder.row_range == (0, 144) and placeholder.frame_range == (0, 12)


def test_slices_cover_rows_frames_and_groups_consistently():
    placeholder = video_placeholder()
    by_groups = placeholder.slice_groups(2, 5)
    assert by_groups == placeholder.slice_frames(4, 10)
    assert by_groups.grid_thw == (3, 4, 6) and by_groups.shape == (72, 1176)
    assert by_groups.row_range == (48, 120) and by_groups.frame_range == (4, 10)
    nested = by_groups.slice_groups(1, 2)  # relative to the slice
    assert (nested.t_start, nested.t_stop, nested.row_range) == (3, 4, (72, 96))
    pieces = placeholder.split_groups([1, 2, 3])
    assert [piece.row_range for piece in pieces] == [(0, 24), (24, 72), (72, 144)]
    assert sum(piece.num_rows for piece in pieces) == placeholder.num_rows


@pytest.mark.parametrize("call", [
    lambda p: p.slice_groups(3, 7), lambda p: p.slice_groups(2, 2), lambda p: p.slice_frames(1, 4),
    lambda p: p.split_groups([2, 2]), lambda p: p.split_groups([6, 0]),
])
def test_invalid_slices_name_the_sample(call):
    with pytest.raises(ValueError, match="sample 's' item 1"):
        call(video_placeholder())


def test_sample_meta_placeholders_and_predicted_shapes_agree():
    image = ItemMeta(MediaItem("image", "a.png"), MediaInfo(100, 80), (84, 112), (1, 6, 8))
    video = ItemMeta(MediaItem("video", "v.mp4"), MediaInfo(64, 48, 40, 8.0, 5.0), (56, 84), (5, 4, 6),
                     frame_indices=tuple(range(0, 40, 4)), second_per_grid_t=1.0)
    meta = SampleMeta("s", Record("s", "<image><video>", (image.item, video.item)), (image, video))
    placeholders = meta.placeholders()
    assert [p.key for p in placeholders] == ["pixel_values", "pixel_values_videos"]
    assert meta.predicted_shapes() == {"pixel_values": (48, 1176), "image_grid_thw": (1, 3),
                                       "pixel_values_videos": (120, 1176), "video_grid_thw": (1, 3)}
    assert meta.vision_tokens == sum(p.vision_tokens for p in placeholders) == 12 + 30
    assert (meta.num_images, meta.num_frames) == (1, 10)
    assert pickle.loads(pickle.dumps(meta)) == meta
    assert placeholders[1].to_json()["shape"] == [120, 1176]
    assert meta.workload_entry(text_tokens=100) == {"id": "s", "tokens": 142, "vision_tokens": 42,
                                                    "images": 1, "frames": 10}
