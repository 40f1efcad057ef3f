"""DataConfig: the `flexrl.data` section (media settings, loader, pool), validation and processor-folder
geometry."""

from __future__ import annotations

import json

import pytest

from flexrl_ds.config.flexrl_config import parse_run_config
from flexrl_ds.loader.config import DataConfig, LoaderConfig, PoolConfig
from flexrl_ds.media import image_io, video_backends
from flexrl_ds.media.config import TRANSPARENCY_MODES, VIDEO_BACKENDS, MediaConfig


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
        {"min_pixels": 1568, "max_pixels": 25088, "min_frames": 2, "max_frames": 64, "fps": 1.0,
         "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    config = DataConfig(bad_record_policy="replace").with_processor_dir(tmp_path)
    assert (config.image_min_pixels, config.image_max_pixels) == (3136, 50176)
    assert (config.video_min_pixels, config.video_max_pixels) == (1568, 25088)
    assert (config.video_min_frames, config.video_max_frames, config.video_fps) == (2, 64, 1.0)
    assert config.image_mean == [0.5, 0.5, 0.5] and config.bad_record_policy == "replace"
    with pytest.raises(ValueError, match="missing: no such directory"):
        DataConfig().with_processor_dir(tmp_path / "missing")


def test_loader_and_pool_sections_are_the_loader_configs():
    defaults = DataConfig()
    assert (defaults.loader, defaults.pool) == (LoaderConfig(global_batch=8), PoolConfig())  # today's defaults
    run = parse_run_config({"flexrl": {"data": {
        "bad_record_policy": "replace",
        "loader": {"global_batch": 6, "num_samples_per_prompt": 4, "seed": 3, "shuffle": False,
                   "lookahead_steps": 2, "groups_per_chunk": 3},
        "pool": {"num_actors_per_node": 2, "num_cpus_per_actor": 0.5, "probe_chunk_size": 5, "timeout_s": 30},
    }}})
    data = run.flexrl.data
    assert data.loader == LoaderConfig(global_batch=6, num_samples_per_prompt=4, seed=3, shuffle=False,
                                       lookahead_steps=2, groups_per_chunk=3)
    assert data.pool == PoolConfig(num_actors_per_node=2, num_cpus_per_actor=0.5, probe_chunk_size=5, timeout_s=30.0)
    assert data.bad_record_policy == "replace"  # passed to the loader as its own argument


def test_processor_dir_keeps_the_loader_and_pool_and_the_class(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"size": {"shortest_edge": 3136,
                                                                            "longest_edge": 50176}}))
    data = DataConfig(loader=LoaderConfig(global_batch=3), pool=PoolConfig(timeout_s=5.0))
    read = data.with_processor_dir(tmp_path)
    assert isinstance(read, DataConfig) and (read.loader, read.pool) == (data.loader, data.pool)
    assert read.image_max_pixels == 50176
    media = MediaConfig().with_processor_dir(tmp_path)
    assert type(media) is MediaConfig and not hasattr(media, "loader")
    assert {name: getattr(read, name) for name in vars(media)} == vars(media)  # same media settings


def test_loader_configs_check_their_values_when_built_in_code():
    with pytest.raises(ValueError, match="flexrl.data.loader.groups_per_chunk: must be at least 1"):
        LoaderConfig(groups_per_chunk=0)
    with pytest.raises(ValueError, match="flexrl.data.pool.timeout_s: must be positive"):
        PoolConfig(timeout_s=0)


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


# ---- processor files: honoured, checked, ignored (flexrl_ds/media/processor_files.py) -------------
QWEN_FILE = {  # what transformers writes for Qwen2.5-VL (keys of every kind)
    "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 0.00392156862745098,
    "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "do_convert_rgb": True, "patch_size": 14,
    "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 3136, "max_pixels": 12845056,
    "size": {"shortest_edge": 3136, "longest_edge": 12845056},
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
}
QWEN_VIDEO = {"video_processor_type": "Qwen2VLVideoProcessor", "do_sample_frames": False, "fps": 2.0,
              "min_frames": 4, "max_frames": 768, "num_frames": None, "crop_size": None, "do_center_crop": None,
              "do_pad": None, "data_format": "channels_first", "default_to_square": True, "device": None,
              "input_data_format": None, "return_metadata": False, "video_metadata": None,
              **{k: v for k, v in QWEN_FILE.items() if k not in ("image_processor_type",)}}


def write_processor(folder, image=None, video=None, nested=None):
    """Processor files in `folder`; `None` leaves a file out."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in (("preprocessor_config.json", image), ("video_preprocessor_config.json", video),
                          ("processor_config.json", nested)):
        if content is not None:
            (folder / name).write_text(json.dumps(content))
    return folder


def test_saved_qwen_processor_reads_cleanly(tmp_path):
    config = DataConfig(transparency="drop").with_processor_dir(write_processor(tmp_path, QWEN_FILE, QWEN_VIDEO))
    assert (config.image_min_pixels, config.image_max_pixels) == (3136, 12845056)
    assert (config.video_min_pixels, config.video_max_pixels) == (3136, 12845056)
    assert (config.rescale_factor, config.do_normalize, config.transparency) == (1 / 255, True, "drop")
    assert config.video_max_total_tokens is None  # cap_pixels_per_frame not set: HF does not cap


def test_top_level_min_max_pixels_override_size_as_in_transformers(tmp_path):
    image = dict(QWEN_FILE, size={"shortest_edge": 3136, "longest_edge": 50176}, max_pixels=28 * 28 * 16)
    image.pop("min_pixels")
    config = DataConfig().with_processor_dir(write_processor(tmp_path, image))
    assert (config.image_min_pixels, config.image_max_pixels) == (3136, 28 * 28 * 16)
    assert (config.video_min_pixels, config.video_max_pixels) == (3136, 28 * 28 * 16)  # video falls back to it


def test_processor_config_json_nested_settings_come_first(tmp_path):
    nested = {"processor_class": "Qwen2_5_VLProcessor",
              "image_processor": dict(QWEN_FILE, min_pixels=1568, max_pixels=28 * 28 * 64),
              "video_processor": dict(QWEN_VIDEO, min_pixels=1568, max_pixels=28 * 28 * 32, fps=1.0)}
    folder = write_processor(tmp_path, QWEN_FILE, QWEN_VIDEO, nested)
    config = DataConfig().with_processor_dir(folder)
    assert (config.image_min_pixels, config.image_max_pixels, config.video_max_pixels) == (1568, 50176, 25088)
    assert config.video_fps == 1.0
    only_nested = DataConfig().with_processor_dir(write_processor(tmp_path / "v5", nested=nested))
    assert only_nested == config


def test_missing_keys_take_the_class_defaults_not_the_configs(tmp_path):
    folder = write_processor(tmp_path, {"image_processor_type": "Qwen2VLImageProcessor"})
    custom = DataConfig(image_mean=[0.5, 0.5, 0.5], image_max_pixels=28 * 28 * 4, video_fps=1.0, rescale_factor=0.5)
    config = custom.with_processor_dir(folder)
    defaults = DataConfig()
    for name in ("image_mean", "image_std", "rescale_factor", "do_normalize", "patch_size", "image_min_pixels",
                 "image_max_pixels", "video_min_pixels", "video_max_pixels", "video_min_frames", "video_max_frames"):
        assert getattr(config, name) == getattr(defaults, name), name
    assert config.video_fps == 1.0  # a processor-call argument in HF: the config's value stays


@pytest.mark.parametrize("changes, honoured", [
    ({"do_rescale": False}, {"rescale_factor": 1.0}),
    ({"rescale_factor": 1 / 256}, {"rescale_factor": 1 / 256}),
    ({"do_normalize": False}, {"do_normalize": False}),
    ({"image_mean": 0.5, "image_std": 0.25}, {"image_mean": [0.5] * 3, "image_std": [0.25] * 3}),
    ({"cap_pixels_per_frame": True}, {"video_max_total_tokens": 128000}),
    ({"cap_pixels_per_frame": True, "max_video_tokens": 4096}, {"video_max_total_tokens": 4096}),
    ({"cap_pixels_per_frame": False}, {"video_max_total_tokens": None}),
    ({"min_frames": 2, "max_frames": 16, "fps": 0.5}, {"video_min_frames": 2, "video_max_frames": 16, "video_fps": 0.5}),
])
def test_pixel_settings_are_honoured(tmp_path, changes, honoured):
    config = DataConfig(video_max_total_tokens=999).with_processor_dir(
        write_processor(tmp_path, dict(QWEN_FILE, **changes)))
    for name, value in honoured.items():
        assert getattr(config, name) == value, name


@pytest.mark.parametrize("changes", [
    {"do_center_crop": True, "crop_size": {"height": 28, "width": 28}}, {"do_pad": True, "pad_size": 112},
    {"do_sample_frames": True}, {"default_to_square": False}, {"return_tensors": "pt"}, {"some_future_key": 1},
])
def test_keys_that_do_not_change_qwen2_vl_pixels_are_ignored(tmp_path, changes):
    plain = DataConfig().with_processor_dir(write_processor(tmp_path / "a", QWEN_FILE))
    assert DataConfig().with_processor_dir(write_processor(tmp_path / "b", dict(QWEN_FILE, **changes))) == plain


@pytest.mark.parametrize("changes, message", [
    ({"resample": 2}, "resample=2 is not supported; ShadowLoader supports resample=3 only (bicubic"),
    ({"do_resize": False}, "do_resize=false is not supported"),
    ({"do_convert_rgb": False}, "do_convert_rgb=false is not supported"),
    ({"do_rescale": None}, "do_rescale is null"),
    ({"resample": None}, "resample is null"),
    ({"rescale_factor": 0}, "rescale_factor=0: expected a positive number"),
    ({"do_normalize": "yes"}, 'do_normalize="yes": expected true or false'),
    ({"image_mean": [0.5, 0.5]}, "image_mean=[0.5, 0.5]: expected one number or 3"),
    ({"patch_size": 0}, "patch_size=0: expected a positive integer"),
    ({"size": {"min_pixels": 3136, "max_pixels": 50176}, "min_pixels": None, "max_pixels": None},
     "size.shortest_edge=null: expected a positive pixel count"),
    ({"image_processor_type": "SiglipImageProcessor"}, 'image_processor_type="SiglipImageProcessor" is not supported'),
    ({"num_frames": 16}, "num_frames=16 is not supported; ShadowLoader samples frames by fps only"),
    ({"min_pixels": 50176, "max_pixels": 3136}, "processor settings give flexrl.data.image_min_pixels exceeds"),
])
def test_unsupported_settings_are_rejected_naming_file_and_key(tmp_path, changes, message):
    folder = write_processor(tmp_path, dict(QWEN_FILE, **changes))
    with pytest.raises(ValueError) as error:
        DataConfig().with_processor_dir(folder)
    assert message in str(error.value)
    assert str(folder) in str(error.value)


@pytest.mark.parametrize("video_changes, message", [
    ({"video_processor_type": "Qwen3VLVideoProcessor"}, 'video_processor_type="Qwen3VLVideoProcessor" is not supported'),
    ({"temporal_patch_size": 1}, "temporal_patch_size is 1 but 2 in"),
    ({"image_mean": [0.5, 0.5, 0.5]}, "image_mean is [0.5, 0.5, 0.5] but [0.48145466"),
    ({"do_normalize": False}, "do_normalize is False but True in"),
    ({"resample": 1}, "resample=1 is not supported"),
])
def test_video_settings_are_checked_and_must_agree_with_image_settings(tmp_path, video_changes, message):
    folder = write_processor(tmp_path, QWEN_FILE, dict(QWEN_VIDEO, **video_changes))
    with pytest.raises(ValueError) as error:
        DataConfig().with_processor_dir(folder)
    assert message in str(error.value) and "video_preprocessor_config.json" in str(error.value)


def test_video_backend_names_are_the_registry():
    # media/config.py keeps the names so that loading a config never imports torch
    assert VIDEO_BACKENDS == ("auto",) + tuple(video_backends.VIDEO_BACKENDS)
    for name in VIDEO_BACKENDS:
        assert DataConfig.from_dict({"video_backend": name}).video_backend == name


def test_transparency_is_a_strict_choice():
    assert TRANSPARENCY_MODES == ("auto",) + image_io.TRANSPARENCY_POLICIES
    assert DataConfig.from_dict({"transparency": "white"}).transparency == "white"
    with pytest.raises(ValueError, match="flexrl.data.transparency: 'black' is not one of auto, white, drop"):
        DataConfig.from_dict({"transparency": "black"})
    with pytest.raises(ValueError, match="flexrl.data.rescale_factor: must be a positive number"):
        DataConfig(rescale_factor=0.0)


def test_loading_is_shadow_by_default_and_central_on_request():
    assert DataConfig().loading == "shadow"
    assert DataConfig.from_dict({"loading": "central"}).loading == "central"
    with pytest.raises(ValueError, match="flexrl.data.loading: 'verl' is not one of shadow, central"):
        DataConfig.from_dict({"loading": "verl"})
