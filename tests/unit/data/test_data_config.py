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


def test_loader_and_pool_sections_drive_the_loader_configs():
    from flexrl_ds.data.actors import PoolConfig
    from flexrl_ds.data.loader_settings import loader_settings
    from flexrl_ds.data.proxy_loader import LoaderConfig

    defaults = loader_settings(DataConfig())
    assert defaults == (LoaderConfig(global_batch=8), PoolConfig())  # today's defaults
    run = parse_run_config({"flexrl": {"data": {
        "bad_record_policy": "replace",
        "loader": {"global_batch": 6, "num_samples_per_prompt": 4, "seed": 3, "shuffle": False,
                   "lookahead_steps": 2, "groups_per_chunk": 3},
        "pool": {"num_actors_per_node": 2, "num_cpus_per_actor": 0.5, "probe_chunk_size": 5, "timeout_s": 30},
    }}})
    loader_config, pool_config = loader_settings(run.flexrl.data)
    assert loader_config == LoaderConfig(global_batch=6, num_samples_per_prompt=4, seed=3, shuffle=False,
                                         bad_record_policy="replace", lookahead_steps=2, groups_per_chunk=3)
    assert pool_config == PoolConfig(num_actors_per_node=2, num_cpus_per_actor=0.5, groups_per_chunk=3,
                                     probe_chunk_size=5, timeout_s=30.0)


@pytest.mark.parametrize("raw, message", [
    ({"loader": {"global_batch": 0}}, "flexrl.data.loader.global_batch: must be at least 1"),
    ({"loader": {"global_batch": "8"}}, "flexrl.data.loader.global_batch: expected an integer"),
    ({"loader": {"lookahead_steps": -1}}, "flexrl.data.loader.lookahead_steps: must be >= 0"),
    ({"loader": {"shuffle": "yes"}}, "flexrl.data.loader.shuffle: expected bool"),
    ({"loader": {"batch": 8}}, "flexrl.data.loader: unknown key(s) 'batch'"),
    ({"loader": {"bad_record_policy": "skip"}}, "flexrl.data.loader: unknown key(s) 'bad_record_policy'"),
    ({"pool": {"num_cpus_per_actor": 0}}, "flexrl.data.pool.num_cpus_per_actor: must be positive"),
    ({"pool": {"num_actors_per_node": 0}}, "flexrl.data.pool.num_actors_per_node: must be at least 1"),
    ({"pool": {"timeout": 5}}, "flexrl.data.pool: unknown key(s) 'timeout'"),
    ({"pool": 3}, "flexrl.data.pool: expected an object"),
])
def test_loader_and_pool_sections_are_strict(raw, message):
    with pytest.raises(ValueError) as error:
        parse_run_config({"flexrl": {"data": raw}}, source="run.json")
    assert message in str(error.value) and "run.json" in str(error.value)
