"""Sample encoding: pad expansion, video patchify equal to the image processor's, record errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flexrl_ds.models.processing import SampleEncoder, VisionGeometry, normalized_frames, read_records, video_patches


def test_two_identical_frames_patchify_like_the_image_processor(tiny_assets):
    """A still image is a 'video' of one temporal group whose two frames are equal (Qwen2-VL)."""
    from PIL import Image

    encoder = SampleEncoder(tiny_assets["vl"])
    frame = np.random.default_rng(0).integers(0, 255, (70, 100, 3), dtype=np.uint8)
    image_out = encoder.image_processor(images=[Image.fromarray(frame)], return_tensors="pt")
    rows, grid = video_patches(normalized_frames(np.stack([frame, frame]), encoder.geometry), encoder.geometry)
    assert grid == tuple(image_out["image_grid_thw"][0].tolist())
    torch.testing.assert_close(rows, image_out["pixel_values"].float(), atol=2e-2, rtol=0)
    # the only difference allowed is the resize kernel's rounding: means agree much tighter
    assert (rows - image_out["pixel_values"]).abs().mean() < 2e-3


def test_pads_expand_to_merged_tokens_and_response_follows(tiny_assets, vl_samples):
    model, samples = vl_samples
    config = model.config
    for sample in samples.values():
        ids = sample.input_ids
        assert int((ids == config.image_token_id).sum()) == sum(i.num_tokens() for i in sample.of_kind("image"))
        assert int((ids == config.video_token_id).sum()) == sum(i.num_tokens() for i in sample.of_kind("video"))
        assert not bool(torch.isin(ids[sample.response_start:], torch.tensor(
            [config.image_token_id, config.video_token_id])).any())
    records = {r.id: r for r in read_records(tiny_assets["data"])}
    tokenizer = SampleEncoder(tiny_assets["q2"]).tokenizer
    for seq_id, sample in samples.items():
        response = tokenizer.decode(sample.input_ids[sample.response_start:].tolist())
        assert response == records[seq_id].response


def test_video_items_have_even_frames_and_seconds_per_group(vl_samples):
    _, samples = vl_samples
    videos = [i for s in samples.values() for i in s.of_kind("video")]
    assert videos
    for item in videos:
        assert item.pixel_values.shape[0] == item.num_patches
        assert item.second_per_grid_t > 0


def test_marker_count_mismatch_names_the_record(tmp_path):
    (tmp_path / "x.png").write_bytes(b"")
    (tmp_path / "d.jsonl").write_text(json.dumps({"id": "bad-1", "prompt": "<image><image>", "images": ["x.png"],
                                                  "response": "a"}) + "\n")
    with pytest.raises(ValueError, match="bad-1"):
        read_records(tmp_path / "d.jsonl")
    (tmp_path / "e.jsonl").write_text(json.dumps({"id": "esc", "prompt": "<image>", "images": ["../x.png"],
                                                  "response": "a"}) + "\n")
    with pytest.raises(ValueError, match="escapes"):
        read_records(tmp_path / "e.jsonl")


def test_smart_resize_bounds():
    geometry = VisionGeometry(min_pixels=4 * 28 * 28, max_pixels=64 * 28 * 28)
    for height, width in [(10, 10), (1000, 700), (56, 84), (30, 500)]:
        h, w = geometry.resized(height, width)
        assert h % 28 == 0 and w % 28 == 0
        assert h * w <= geometry.max_pixels
