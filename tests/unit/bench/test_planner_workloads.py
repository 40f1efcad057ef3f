"""Workload generator: Qwen2.5-VL token arithmetic and the mixes of bench/workloads.py."""

from __future__ import annotations

import collections

import pytest

from flexrl_ds.bench.workloads import (MIXES, image_tokens, make_step, make_workload, smart_resize, video_frames,
                                       video_tokens)


def test_smart_resize_rounds_to_28_within_pixel_range():
    assert smart_resize(224, 224, 4 * 784, 1024 * 784) == (224, 224)
    assert image_tokens(224, 224, 4 * 784, 1024 * 784) == 64
    for height, width in ((200, 1000), (999, 999), (1000, 201), (30, 30)):
        h, w = smart_resize(height, width, 4 * 784, 1024 * 784)
        assert h % 28 == 0 and w % 28 == 0
        assert 4 * 784 <= h * w <= 1024 * 784
    assert smart_resize(20, 20, 4 * 784, 1024 * 784) == (56, 56)  # upscaled to the minimum


def test_video_frames_clamp_and_temporal_patch():
    assert video_frames(44.0, 16, 64) == 64  # 88 frames at 2 fps, clamped
    assert video_frames(5.0, 16, 64) == 16
    assert video_frames(12.3, 16, 64) == 24
    assert video_frames(10.7, 16, 64) % 2 == 0
    # 448x252 frames under a 448*252 cap: 16x9 blocks per two frames.
    assert video_tokens(512, 252, 448, 448 * 252) == 16 * 9 * 256


def test_make_workload_is_seeded_and_shares_prompt_tokens():
    a = make_workload("image-heavy", 100, seed=3, n_samples=8)
    assert a == make_workload("image-heavy", 100, seed=3, n_samples=8)
    assert a != make_workload("image-heavy", 100, seed=4, n_samples=8)
    assert len(a.sequences) == 100 and len({s.id for s in a.sequences}) == 100
    by_prompt = collections.defaultdict(list)
    for seq in a.sequences:
        by_prompt[seq.id.split("-")[0]].append(seq)
    assert len(by_prompt) == 13  # ceil(100 / 8); the last prompt has 4 samples
    for samples in by_prompt.values():
        assert len({(s.vision_tokens, s.images, s.frames) for s in samples}) == 1
        assert all(s.tokens > s.vision_tokens for s in samples)


def test_mix_weights_and_profiles():
    counts = collections.Counter(s.id[0] for s in make_workload("image-heavy", 4000, 0, n_samples=1).sequences)
    assert counts["i"] / 4000 == pytest.approx(5 / 8, abs=0.04)
    assert counts["l"] / 4000 == pytest.approx(1 / 8, abs=0.03)
    only_video = make_workload("only-video", 400, 1).sequences
    assert all(s.images == 0 and s.frames >= 16 for s in only_video)
    long_videos = [s for s in make_workload("video-heavy", 400, 2).sequences if s.id[0] == "l"]
    assert all(128 <= s.frames <= 512 and s.tokens < 40_000 for s in long_videos)
    assert len(make_step("video-heavy", 4, 3, 0).sequences) == 12


def test_bad_arguments_name_the_option():
    with pytest.raises(ValueError, match="--mix"):
        make_workload("text-only", 10, 0)
    with pytest.raises(ValueError, match="--num"):
        make_workload("image-heavy", 0, 0)
    assert set(MIXES) == {"image-heavy", "video-heavy", "only-video"}
