"""DataConfig: the `flexrl.data` section, validation and processor-folder geometry."""

from __future__ import annotations

import json

import pytest

from flexrl_ds.config.flexrl_config import parse_run_config
from flexrl_ds.data.config import DataConfig


def test_from_run_config_section():
    run = parse_run_config({"zero_optimization": {"stage": 3},
                            "flexrl": {"data": {"video_fps": 1.0, "video_backend": "opencv",
                                                "bad_record_policy": "replace", "media_root": "/data"}}})
    config = run.flexrl.data
    assert isinstance(config, DataConfig)
    assert (config.video_fps, config.video_backend, config.bad_record_policy, config.media_root) == (
        1.0, "opencv", "replace", "/data")
    assert config.factor == 28 and config.image_max_pixels == 28 * 28 * 1280


@pytest.mark.parametrize("raw, message", [
    ({"video_fps": "2"}, "flexrl.data.video_fps: expected a number"),
    ({"frames": 3}, "unknown key(s) 'frames'"),
    ({"video_backend": "decord"}, "flexrl.data.video_backend: 'decord' is not one of"),
    ({"bad_record_policy": "ignore"}, "flexrl.data.bad_record_policy"),
    ({"image_min_pixels": 10_000_000}, "image_min_pixels exceeds"),
    ({"image_mean": [0.5, 0.5]}, "flexrl.data.image_mean: needs 3 values"),
    ({"max_vision_tokens_per_sample": 0}, "max_vision_tokens_per_sample: must be positive"),
])
def test_invalid_values_name_the_key(raw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DataConfig.from_dict(raw)


def test_with_processor_dir(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"shortest_edge": 3136, "longest_edge": 50176}, "patch_size": 14, "merge_size": 2,
         "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(
        {"min_pixels": 1568, "max_pixels": 25088, "min_frames": 2, "max_frames": 64, "fps": 1.0}))
    config = DataConfig(bad_record_policy="replace").with_processor_dir(tmp_path)
    assert (config.image_min_pixels, config.image_max_pixels) == (3136, 50176)
    assert (config.video_min_pixels, config.video_max_pixels) == (1568, 25088)
    assert (config.video_min_frames, config.video_max_frames, config.video_fps) == (2, 64, 1.0)
    assert config.image_mean == [0.5, 0.5, 0.5] and config.bad_record_policy == "replace"
    with pytest.raises(ValueError, match="no preprocessor_config.json"):
        DataConfig().with_processor_dir(tmp_path / "missing")
