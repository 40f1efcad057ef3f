"""mRoPE positions (models/positions.py) against the Qwen2-VL / Qwen2.5-VL rule as released, written
here token by token, and against transformers' own rope index where that never changed in 5.x."""

from __future__ import annotations

import inspect
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from flexrl_ds.models.positions import MropeSpec, mm_token_type_ids, mrope_positions
from flexrl_ds.models.processing import VisionItem

IMAGE, VIDEO, MERGE = 90, 91, 2


def spec_positions(ids: list[int], items: list[VisionItem], tokens_per_second) -> list[tuple[int, int, int]]:
    """One token at a time: text advances (p, p, p); a vision item's tokens in (t, h, w) order get
    start + (T(t), h, w); the next text starts at the largest position so far + 1."""
    out, next_position, index, item_index = [], 0, 0, 0
    while index < len(ids):
        if ids[index] not in (IMAGE, VIDEO):
            out.append((next_position,) * 3)
            next_position, index = next_position + 1, index + 1
            continue
        item = items[item_index]
        item_index += 1
        t, h, w = item.grid_thw
        second = float(np.float32(item.second_per_grid_t))  # the processors' float32 value
        step = second * tokens_per_second if item.kind == "video" and tokens_per_second else 1.0
        for frame in range(t):
            for row in range(h // MERGE):
                for col in range(w // MERGE):
                    out.append((next_position + int(frame * step), next_position + row, next_position + col))
                    index += 1
        next_position = max(max(p) for p in out) + 1
    return out


def random_sequence(rng: random.Random, num_items: int, hf_safe: bool = False):
    """Text and vision items (back to back at times); hf_safe: only what transformers 5.x computes as
    released: text between items, videos of whole seconds per group that reach no further in time
    than in space."""
    ids, items = [], []
    for _ in range(num_items):
        ids += [rng.randrange(0, 80) for _ in range(rng.randint(1 if hf_safe else 0, 5))]
        kind = rng.choice(["image", "video"])
        t = 1 if kind == "image" else rng.randint(1, 2 if hf_safe else 9)
        grid = (t, MERGE * rng.randint(3 if hf_safe else 1, 4), MERGE * rng.randint(3 if hf_safe else 1, 4))
        second = rng.choice([0.5, 0.7, 1.0, 2 / 3, 1.125, 1.21875, 2.0]) if kind == "video" else 1.0
        second = 1.0 if hf_safe else second
        items.append(VisionItem(kind, torch.zeros(t * grid[1] * grid[2], 1), grid, second))
        ids += [IMAGE if kind == "image" else VIDEO] * (t * grid[1] * grid[2] // MERGE ** 2)
    ids += [rng.randrange(0, 80) for _ in range(rng.randint(1, 5))]
    return torch.tensor(ids), items


@pytest.mark.parametrize("tokens_per_second", [2, 4, None])  # Qwen2.5-VL 7B, HF default, Qwen2-VL
def test_positions_follow_the_released_rule_token_by_token(tokens_per_second):
    rng = random.Random(tokens_per_second or 0)
    spec = MropeSpec(IMAGE, VIDEO, MERGE, tokens_per_second)
    long_videos = 0
    for num_items in [0, 1, 1, 2, 3, 5] * 20:
        ids, items = random_sequence(rng, num_items)
        got = mrope_positions(ids, items, spec)
        assert got.dtype == torch.long and got.shape == (3, len(ids))
        assert [tuple(column) for column in got.T.tolist()] == spec_positions(ids.tolist(), items, tokens_per_second)
        long_videos += any(i.kind == "video" and (i.grid_thw[0] - 1) * i.second_per_grid_t * (tokens_per_second or 1)
                           >= max(i.grid_thw[1:]) // MERGE for i in items)
    assert long_videos > 10  # videos reaching further in time than in space are covered


def test_text_after_a_long_video_starts_after_its_last_frame():
    """A video whose temporal positions reach past its spatial ones (here 0, 2, 4, 6 against rows and
    columns 0..2): the next text starts at the video's largest position + 1 (transformers 5.x puts it
    at start + max(h, w) = 3 instead)."""
    item = VisionItem("video", torch.zeros(4 * 6 * 6, 1), (4, 6, 6), 1.0)
    ids = torch.tensor([1, 2] + [VIDEO] * 36 + [3])
    positions = mrope_positions(ids, [item], MropeSpec(IMAGE, VIDEO, MERGE, 2))
    assert positions[:, -1].tolist() == [2 + 6 + 1] * 3
    assert positions[0, 2:38].unique().tolist() == [2, 4, 6, 8]


def test_pads_and_items_must_agree():
    spec = MropeSpec(IMAGE, VIDEO, MERGE, 2)
    image = VisionItem("image", torch.zeros(16, 1), (1, 4, 4), 1.0)
    with pytest.raises(ValueError, match=r"vision item 0 \(image, grid \(1, 4, 4\)\): expected a run of 4"):
        mrope_positions(torch.tensor([1, IMAGE, IMAGE, 2]), [image], spec)
    with pytest.raises(ValueError, match="4 vision pad tokens after the last of 1"):
        mrope_positions(torch.tensor([1] + [IMAGE] * 8), [image], spec)
    video = VisionItem("video", torch.zeros(16, 1), (1, 4, 4), 1.0)
    with pytest.raises(ValueError, match=r"vision item 0 \(image.*as the next vision tokens"):
        mrope_positions(torch.tensor([1] + [VIDEO] * 4 + [IMAGE] * 4), [image, video], spec)
    with pytest.raises(ValueError, match="an image has one temporal group"):
        mrope_positions(torch.tensor([IMAGE] * 8), [VisionItem("image", torch.zeros(32, 1), (2, 4, 4), 1.0)], spec)


def test_video_time_uses_the_processors_float32_seconds():
    """0.7 s per group at 2 tokens/s: 5 * (0.7 * 2) is 7.0 in float64 but group 5 of a video whose
    second_per_grid_ts the processor stored as float32 (0.699999988) lands at 6, as in vLLM."""
    video = VisionItem("video", torch.zeros(6 * 4 * 4, 1), (6, 4, 4), 0.7)
    positions = mrope_positions(torch.tensor([VIDEO] * 24), [video], MropeSpec(IMAGE, VIDEO, MERGE, 2))
    assert positions[0].unique().tolist() == [int(t * (float(np.float32(0.7)) * 2)) for t in range(6)]
    assert positions[0].unique().tolist()[-1] == 6


def test_equal_to_transformers_where_its_rule_never_changed():
    """Images anywhere, and videos with whole seconds per temporal group whose temporal positions stay
    within their spatial ones: every transformers 5.x release computes these as released."""
    import transformers
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

    config = transformers.Qwen2_5_VLConfig(image_token_id=IMAGE, video_token_id=VIDEO,
                                           vision_config={"spatial_merge_size": MERGE, "tokens_per_second": 2})
    holder = SimpleNamespace(config=config)
    holder.get_vision_position_ids = getattr(Qwen2_5_VLModel, "get_vision_position_ids", None)
    if holder.get_vision_position_ids is not None:
        holder.get_vision_position_ids = holder.get_vision_position_ids.__get__(holder)
    rng = random.Random(3)
    for _ in range(40):
        ids, items = random_sequence(rng, rng.randint(1, 3), hf_safe=True)
        theirs = _hf_positions(Qwen2_5_VLModel.get_rope_index, holder, ids, items)
        assert torch.equal(mrope_positions(ids, items, MropeSpec.from_config(config)), theirs)


def _hf_positions(get_rope_index, holder, ids: torch.Tensor, items: list[VisionItem]) -> torch.Tensor:
    images = [list(i.grid_thw) for i in items if i.kind == "image"]
    videos = [list(i.grid_thw) for i in items if i.kind == "video"]
    kwargs = dict(image_grid_thw=torch.tensor(images) if images else None,
                  video_grid_thw=torch.tensor(videos) if videos else None,
                  second_per_grid_ts=torch.tensor([i.second_per_grid_t for i in items if i.kind == "video"])
                  if videos else None, attention_mask=None)
    if "mm_token_type_ids" in inspect.signature(get_rope_index).parameters:
        kwargs["mm_token_type_ids"] = mm_token_type_ids(ids.view(1, -1), IMAGE, VIDEO)
    positions, _ = get_rope_index(holder, ids.view(1, -1), **kwargs)
    return positions[:, 0, :]
