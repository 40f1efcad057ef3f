"""SamplePreprocessor against the Hugging Face Qwen2-VL processors, and predicted == actual shapes.

Both sides are configured from the same saved processor - `make-tiny-model`'s preprocessor JSON
(`processor_dir`), with this module's pixel and frame limits: HF's processors are loaded from it with
`from_pretrained`, ours reads it with `MediaConfig.with_processor_dir`. Nothing relies on a processor
class's constructor defaults, which drift between transformers releases.

References:
- images: transformers' `Qwen2VLImageProcessorPil` (the PIL backend) everywhere, its torchvision
  backend `Qwen2VLImageProcessor` where torchvision is importable, and `AutoImageProcessor`
  (whichever transformers picks here), called on the files through their public API - including
  transparent images, which transformers turns into RGB differently by release (5.17/5.18 drop the
  alpha, 5.24 composites onto white; `image_io.hf_transparency_policy`);
- videos: the full `Qwen2VLVideoProcessor` where torchvision is importable (GPU machine); here, the
  same pipeline assembled from transformers' own pieces - its `sample_frames` and `patchify` (from
  its source), `smart_resize`, `rescale`/`normalize` - around frames decoded directly with
  torchcodec and resized like torchvision's tensor resize (antialiased bicubic interpolate on uint8).
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.image_transforms import normalize as hf_normalize
from transformers.image_transforms import rescale as hf_rescale
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from flexrl_ds.media import image_io
from flexrl_ds.media.config import MediaConfig
from flexrl_ds.media.image_io import resize_pil, resize_torch
from flexrl_ds.media.preprocess import SamplePreprocessor, collate
from flexrl_ds.media.types import MediaItem, Record, SampleMeta

IMAGE_SIZE = {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 64}
VIDEO_LIMITS = {"size": {"shortest_edge": 28 * 28 * 4, "longest_edge": 28 * 28 * 24}, "min_frames": 4, "max_frames": 12}


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory):
    """The tiny model's saved processor files (as make-tiny-model writes them) with this module's limits."""
    from flexrl_ds.models.tiny import TinyModelConfig, processor_configs

    folder = tmp_path_factory.mktemp("processor")
    files = processor_configs(TinyModelConfig(out_dir=str(folder)))
    files["preprocessor_config.json"]["size"] = dict(IMAGE_SIZE)
    files["video_preprocessor_config.json"].update(VIDEO_LIMITS)
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content))
    return folder


@pytest.fixture(scope="module")
def config(processor_dir) -> MediaConfig:
    """Our preprocessing configured from the same files; images resized with PIL (HF's PIL backend)."""
    return MediaConfig(resize_impl="pil").with_processor_dir(processor_dir)


@pytest.fixture(scope="module")
def transparent_images(tmp_path_factory):
    """Images with transparency in every form PNG stores it: alpha bands (RGBA, LA), a palette with
    a transparent index (P), and a transparent colour key on RGB and greyscale (tRNS)."""
    from PIL import Image

    folder = tmp_path_factory.mktemp("transparent")
    rng = np.random.default_rng(5)
    rgb = Image.fromarray(rng.integers(0, 256, (61, 87, 3), dtype=np.uint8))
    alpha = Image.fromarray(rng.integers(0, 256, (61, 87), dtype=np.uint8))
    palette = rgb.quantize(colors=16)
    key = tuple(int(v) for v in np.asarray(rgb)[0, 0])
    images = {"rgba.png": (Image.merge("RGBA", (*rgb.split(), alpha)), {}),
              "la.png": (Image.merge("LA", (rgb.convert("L"), alpha)), {}),
              "palette.png": (palette, {"transparency": int(np.asarray(palette)[0, 0])}),
              "rgb_key.png": (rgb, {"transparency": key}),
              "grey_key.png": (rgb.convert("L"), {"transparency": int(np.asarray(rgb.convert("L"))[0, 0])})}
    paths = []
    for name, (image, options) in images.items():
        image.save(folder / name, **options)
        paths.append(folder / name)
    return paths


def record_of(*paths, kind_of=None, **options) -> Record:
    items = tuple(MediaItem("video" if str(p).endswith(".mp4") else "image", str(p), source=str(p), **options)
                  for p in paths)
    markers = "".join(f"<{item.kind}>" for item in items)
    return Record(id="r", prompt=markers + "q", items=items)


def assert_images_equal_hf(hf, preprocessor: SamplePreprocessor, paths) -> None:
    from PIL import Image

    for path in paths:
        meta, outputs = preprocessor.process(record_of(path))
        with Image.open(path) as image:
            expected = hf(images=[image], return_tensors="pt")
        assert torch.equal(outputs["image_grid_thw"], expected["image_grid_thw"]), path.name
        torch.testing.assert_close(outputs["pixel_values"], expected["pixel_values"], atol=1e-5, rtol=0,
                                   msg=lambda text: f"{path.name}: {text}")


def test_config_is_the_processor_files(config):
    assert (config.image_min_pixels, config.image_max_pixels) == tuple(IMAGE_SIZE.values())
    assert (config.video_min_pixels, config.video_max_pixels) == tuple(VIDEO_LIMITS["size"].values())
    assert (config.video_min_frames, config.video_max_frames) == (4, 12)


def test_images_equal_hf_image_processor(media, transparent_images, processor_dir, config):
    from transformers import Qwen2VLImageProcessorPil

    hf = Qwen2VLImageProcessorPil.from_pretrained(processor_dir)
    assert_images_equal_hf(hf, SamplePreprocessor(config), media.images + transparent_images)


def test_images_equal_hf_torchvision_image_processor_where_torchvision_exists(media, transparent_images,
                                                                              processor_dir, config):
    pytest.importorskip("torchvision", reason="transformers' torchvision image backend needs torchvision")
    from transformers import Qwen2VLImageProcessor

    hf = Qwen2VLImageProcessor.from_pretrained(processor_dir)
    preprocessor = SamplePreprocessor(replace(config, resize_impl="auto"))
    assert preprocessor.image_resize_impl == "torch"
    assert_images_equal_hf(hf, preprocessor, media.images + transparent_images)


def test_images_equal_auto_image_processor(media, transparent_images, processor_dir):
    """The processor transformers itself picks for the folder, against `resize_impl="auto"`."""
    from transformers import AutoImageProcessor

    try:
        hf = AutoImageProcessor.from_pretrained(processor_dir)
    except ImportError as error:  # transformers 5.17 without torchvision cannot build AutoImageProcessor
        pytest.skip(f"AutoImageProcessor unavailable here: {str(error).strip().splitlines()[0]}")
    preprocessor = SamplePreprocessor(MediaConfig().with_processor_dir(processor_dir))
    assert_images_equal_hf(hf, preprocessor, media.images + transparent_images)


def test_several_images_in_one_sample_equal_hf_batch(media, transparent_images, processor_dir, config):
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    hf = Qwen2VLImageProcessorPil.from_pretrained(processor_dir)
    paths = media.images[:3] + transparent_images[:2]
    meta, outputs = SamplePreprocessor(config).process(record_of(*paths))
    expected = hf(images=[Image.open(p) for p in paths], return_tensors="pt")
    assert torch.equal(outputs["image_grid_thw"], expected["image_grid_thw"])
    torch.testing.assert_close(outputs["pixel_values"], expected["pixel_values"], atol=1e-5, rtol=0)


def test_transparency_policies(transparent_images):
    """"drop" is PIL's convert("RGB"); "white" blends onto white (fully transparent -> 255, opaque
    unchanged); "auto" is what the installed transformers does."""
    from PIL import Image

    rgba = transparent_images[0]
    with Image.open(rgba) as image:
        pixels_HWC = np.asarray(image)
        dropped = torch.from_numpy(np.asarray(image.convert("RGB")).copy()).permute(2, 0, 1)
    assert torch.equal(image_io.load_image_rgb(str(rgba), "drop"), dropped)
    white = image_io.load_image_rgb(str(rgba), "white").permute(1, 2, 0).numpy().astype(float)
    alpha = pixels_HWC[..., 3:] / 255.0
    blended = alpha * pixels_HWC[..., :3] + (1 - alpha) * 255.0
    assert np.abs(white - blended).max() <= 1.0  # PIL's integer blending rounds
    assert image_io.hf_transparency_policy() in image_io.TRANSPARENCY_POLICIES
    auto = image_io.load_image_rgb(str(rgba))
    assert torch.equal(auto, image_io.load_image_rgb(str(rgba), image_io.hf_transparency_policy()))
    with pytest.raises(ValueError, match="transparency"):
        image_io.load_image_rgb(str(rgba), "black")


def reference_video(path, hf_video_functions, config: MediaConfig, fps=None):
    """HF's Qwen2-VL video pipeline from its own pieces (see module docstring)."""
    decoders = pytest.importorskip("torchcodec.decoders", reason="the reference decodes with torchcodec")
    VideoDecoder = decoders.VideoDecoder

    decoder = VideoDecoder(str(path), seek_mode="exact")
    total, video_fps = decoder.metadata.num_frames, decoder.metadata.average_fps
    indices = hf_video_functions.sample_frames(total, video_fps, fps=fps or config.video_fps,
                                               min_frames=config.video_min_frames,
                                               max_frames=config.video_max_frames, temporal_patch_size=2)
    frames = decoder.get_frames_at(indices=indices).data
    height, width = smart_resize(frames.shape[-2], frames.shape[-1], 28, config.video_min_pixels, config.video_max_pixels)
    resized = F.interpolate(frames, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    normalised = [hf_normalize(hf_rescale(frame.numpy(), 1 / 255), config.image_mean, config.image_std,
                               input_data_format="channels_first") for frame in resized]
    videos = torch.from_numpy(np.stack(normalised)).float().unsqueeze(0)
    patches, grid_t, grid_h, grid_w = hf_video_functions.patchify(videos)
    return indices, patches[0], (grid_t, grid_h, grid_w)


def test_videos_equal_hf_video_pipeline(media, hf_video_functions, config):
    preprocessor = SamplePreprocessor(config)
    for path in media.videos:
        meta, outputs = preprocessor.process(record_of(path))
        indices, patches, grid = reference_video(path, hf_video_functions, config)
        assert list(meta.items[0].frame_indices) == indices, path.name
        assert outputs["video_grid_thw"].tolist() == [list(grid)], path.name
        torch.testing.assert_close(outputs["pixel_values_videos"], patches, atol=1e-5, rtol=0)


def test_videos_equal_hf_video_processor_where_torchvision_exists(media, processor_dir, config):
    pytest.importorskip("torchvision", reason="transformers' Qwen2-VL video processor needs torchvision")
    from transformers import Qwen2VLVideoProcessor

    from flexrl_ds.media.video_backends import get_video_backend

    hf = Qwen2VLVideoProcessor.from_pretrained(processor_dir)
    preprocessor = SamplePreprocessor(config)
    backend = get_video_backend("auto")
    for path in media.videos:
        meta, outputs = preprocessor.process(record_of(path))
        info = backend.probe(str(path))
        frames = backend.decode(str(path), list(range(info.num_frames)))  # HF samples from all frames
        metadata = {"total_num_frames": info.num_frames, "fps": info.fps, "duration": info.duration,
                    "height": info.height, "width": info.width}
        expected = hf(videos=[frames], video_metadata=[metadata], do_sample_frames=True, fps=config.video_fps,
                      cap_pixels_per_frame=False, return_tensors="pt")
        assert torch.equal(outputs["video_grid_thw"], expected["video_grid_thw"]), path.name
        torch.testing.assert_close(outputs["pixel_values_videos"], expected["pixel_values_videos"], atol=1e-5, rtol=0)


def test_torch_resize_close_to_pil_resize():
    frames = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (2, 3, 97, 131), dtype=np.uint8))
    for size in ((56, 84), (196, 252), (28, 28)):
        difference = (resize_torch(frames, size).int() - resize_pil(frames, size).int()).abs()
        assert difference.float().mean() < 1.0 and difference.max() <= 8, size


def test_predicted_shapes_equal_materialised_shapes_everywhere(media, config):
    preprocessor = SamplePreprocessor(config)
    for paths in ([p] for p in media.images + media.videos):
        meta, outputs = preprocessor.process(record_of(*paths))
        actual = {key: tuple(value.shape) for key, value in outputs.items() if isinstance(value, torch.Tensor)}
        assert actual == meta.predicted_shapes(), paths
    mixed = [media.images[0], media.videos[1], media.images[3], media.videos[0]]
    meta, outputs = preprocessor.process(record_of(*mixed))
    actual = {key: tuple(value.shape) for key, value in outputs.items() if isinstance(value, torch.Tensor)}
    assert actual == meta.predicted_shapes()
    assert meta.vision_tokens == sum(item.vision_tokens for item in meta.items) > 0


def test_placeholder_slices_materialise_to_the_same_rows(media, config):
    preprocessor = SamplePreprocessor(config)
    meta = preprocessor.probe(record_of(media.images[1], media.videos[0]))
    assert isinstance(meta, SampleMeta)
    tensors = preprocessor.materialize(meta)
    video = meta.item_placeholder(1)
    assert video.key == "pixel_values_videos" and video.shape == tuple(tensors[1].pixel_values.shape)
    assert video.grid_thw[0] >= 4
    pieces = video.split_groups([1, video.grid_thw[0] - 3, 2])
    rebuilt = torch.cat([preprocessor.materialize_slice(meta, piece) for piece in pieces])
    assert torch.equal(rebuilt, tensors[1].pixel_values)
    for piece in pieces:
        start, stop = piece.row_range
        assert preprocessor.materialize_slice(meta, piece).shape == piece.shape == (stop - start, 1176)
    image = meta.item_placeholder(0)
    assert torch.equal(preprocessor.materialize_slice(meta, image), tensors[0].pixel_values)
    assert collate(meta, tensors)["pixel_values"].shape == (image.num_rows, 1176)


def test_tiny_model_processor_dir_sets_geometry(tmp_path):
    from flexrl_ds.models.tiny import TinyModelConfig, processor_configs

    config = TinyModelConfig(out_dir=str(tmp_path))
    files = processor_configs(config)
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    data_config = MediaConfig().with_processor_dir(tmp_path)
    assert (data_config.image_min_pixels, data_config.image_max_pixels) == (config.min_pixels, config.max_pixels)
    assert (data_config.video_min_pixels, data_config.video_max_pixels) == (config.min_pixels, config.max_pixels)
    image, video = files["preprocessor_config.json"], files["video_preprocessor_config.json"]
    for key in ("patch_size", "merge_size", "temporal_patch_size", "image_mean", "image_std"):
        assert getattr(data_config, key) == image[key], key
    assert (data_config.video_min_frames, data_config.video_max_frames) == (video["min_frames"], video["max_frames"])
    assert data_config.video_fps == video["fps"]


def test_video_where_hf_sampling_runs_past_the_end(tmp_path, config):
    """185 frames at 8 fps sampled at 2 fps: HF's float32 positions are 47, the last one 185 (past
    the end, HF's own decode fails); ours are the other 46, and the sample decodes fine."""
    from flexrl_ds.bench.datasets import write_video

    path = tmp_path / "v185.mp4"
    write_video(path, 185, 32, 24, 8)
    meta, outputs = SamplePreprocessor(replace(config, video_max_frames=768)).process(record_of(path))
    assert len(meta.items[0].frame_indices) == 46 and meta.items[0].frame_indices[-1] == 180
    assert meta.items[0].grid_thw[0] == 23
    actual = {key: tuple(value.shape) for key, value in outputs.items() if isinstance(value, torch.Tensor)}
    assert actual == meta.predicted_shapes()


# ---- processor settings beyond the defaults: both sides read the same files ---------------------
SETTING_VARIANTS = {
    "rescale_1_256": {"rescale_factor": 1 / 256},
    "no_rescale": {"do_rescale": False},
    "no_normalize": {"do_normalize": False},
    "scalar_mean_std": {"image_mean": 0.5, "image_std": 0.25},
    "top_level_max_pixels_over_size": {"max_pixels": 28 * 28 * 9},
    "ignored_crop_and_pad": {"do_center_crop": True, "crop_size": {"height": 28, "width": 28},
                             "do_pad": True, "pad_size": {"height": 896, "width": 896}},
}


def processor_variant(processor_dir, folder, changes):
    """`processor_dir`'s files with `changes` applied to both the image and the video settings."""
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json"):
        content = json.loads((processor_dir / name).read_text()) if (processor_dir / name).exists() else None
        if content is not None and name != "processor_config.json":
            content.update(changes)
        if content is not None:
            (folder / name).write_text(json.dumps(content))
    return folder


@pytest.mark.parametrize("variant", sorted(SETTING_VARIANTS))
def test_processor_settings_equal_hf_image_processor(media, transparent_images, processor_dir, tmp_path, variant):
    from transformers import Qwen2VLImageProcessorPil

    folder = processor_variant(processor_dir, tmp_path, SETTING_VARIANTS[variant])
    hf = Qwen2VLImageProcessorPil.from_pretrained(folder)
    preprocessor = SamplePreprocessor(MediaConfig(resize_impl="pil").with_processor_dir(folder))
    for path in media.images[:4] + transparent_images[:1]:
        meta, outputs = preprocessor.process(record_of(path))
        with Image_open(path) as image:
            expected = hf(images=[image], return_tensors="pt")
        assert torch.equal(outputs["image_grid_thw"], expected["image_grid_thw"]), (variant, path.name)
        torch.testing.assert_close(outputs["pixel_values"], expected["pixel_values"], atol=1e-5, rtol=1e-6,
                                   msg=lambda text: f"{variant} {path.name}: {text}")


def Image_open(path):
    from PIL import Image

    return Image.open(path)


@pytest.mark.parametrize("variant", ["rescale_1_256", "no_normalize", "scalar_mean_std"])
def test_processor_settings_equal_hf_video_pipeline(media, hf_video_functions, processor_dir, tmp_path, variant):
    """Videos through the reference pipeline above, with HF's rescale/normalize set as the files say."""
    decoders = pytest.importorskip("torchcodec.decoders", reason="the reference decodes with torchcodec")
    folder = processor_variant(processor_dir, tmp_path, SETTING_VARIANTS[variant])
    config = MediaConfig(resize_impl="pil").with_processor_dir(folder)
    settings = json.loads((folder / "video_preprocessor_config.json").read_text())
    path = media.videos[0]
    meta, outputs = SamplePreprocessor(config).process(record_of(path))
    frames = decoders.VideoDecoder(str(path), seek_mode="exact").get_frames_at(indices=list(meta.items[0].frame_indices)).data
    height, width = meta.items[0].resized_hw
    resized = F.interpolate(frames, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    processed = []
    for frame in resized.numpy():
        frame = hf_rescale(frame, settings.get("rescale_factor", 1 / 255)) if settings.get("do_rescale", True) else frame
        if settings.get("do_normalize", True):
            frame = hf_normalize(frame, settings["image_mean"], settings["image_std"], input_data_format="channels_first")
        processed.append(frame)
    patches, *grid = hf_video_functions.patchify(torch.from_numpy(np.stack(processed)).float().unsqueeze(0))
    assert outputs["video_grid_thw"].tolist() == [grid]
    torch.testing.assert_close(outputs["pixel_values_videos"], patches[0], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("transparency", ["white", "drop"])
def test_pinned_transparency_equals_hf_on_the_image_converted_that_way(transparent_images, processor_dir,
                                                                       config, transparency):
    """`flexrl.data.transparency` pins the conversion whatever transformers is installed: HF's
    processor, given the image already made RGB that way (compositing onto white / PIL convert),
    produces the same tensors. The reference is rebuilt from its pixels: PIL's convert("RGB") of a
    palette image keeps a transparent colour key, which HF would composite onto white again."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    hf = Qwen2VLImageProcessorPil.from_pretrained(processor_dir)
    preprocessor = SamplePreprocessor(replace(config, transparency=transparency))
    for path in transparent_images:
        with Image.open(path) as image:
            if transparency == "drop":
                rgb = image.convert("RGB")
            else:
                rgba = image.convert("RGBA")
                rgb = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
        expected = hf(images=[Image.fromarray(np.asarray(rgb))], return_tensors="pt")
        meta, outputs = preprocessor.process(record_of(path))
        torch.testing.assert_close(outputs["pixel_values"], expected["pixel_values"], atol=1e-5, rtol=0,
                                   msg=lambda text: f"{transparency} {path.name}: {text}")


def _typed_dict_keys(source: str, class_name: str) -> set[str]:
    import ast

    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            return {item.target.id for item in node.body if isinstance(item, ast.AnnAssign)}
    raise LookupError(class_name)


def test_every_kwarg_of_the_hf_qwen2_vl_processors_is_classified(hf_video_functions):
    """A transformers release adding a pixel setting to these processors fails here until
    processor_files.py honours, checks or ignores it."""
    import importlib.util
    from pathlib import Path

    from transformers import Qwen2VLImageProcessorPil
    from transformers.processing_utils import VideosKwargs

    from flexrl_ds.media import processor_files as pf

    classified = set(pf.COMMON_KEYS + pf.SIZE_KEYS + pf.VIDEO_KEYS + pf.TYPE_KEYS) | pf.IGNORED_KEYS
    image_keys = set(Qwen2VLImageProcessorPil.valid_kwargs.__annotations__)
    source = (Path(importlib.util.find_spec("transformers").origin).parent / "models" / "qwen2_vl"
              / "video_processing_qwen2_vl.py").read_text()
    video_keys = set(VideosKwargs.__annotations__) | _typed_dict_keys(source, "Qwen2VLVideoProcessorInitKwargs")
    assert not image_keys - classified and not video_keys - classified, (image_keys | video_keys) - classified


def test_class_defaults_are_transformers(hf_video_functions):
    import ast
    import importlib.util
    from pathlib import Path

    from transformers import Qwen2VLImageProcessorPil

    from flexrl_ds.media import processor_files as pf

    hf_image = Qwen2VLImageProcessorPil
    for key, value in pf.CLASS_DEFAULTS.items():
        if hasattr(hf_image, key):
            hf_value = getattr(hf_image, key)
            assert (list(hf_value) if isinstance(hf_value, (list, tuple)) else hf_value) == value, key
        if key in hf_video_functions.defaults:
            assert hf_video_functions.defaults[key] == value, key
    assert dict(hf_image.size) == pf.IMAGE_SIZE_DEFAULT
    source = (Path(importlib.util.find_spec("transformers").origin).parent / "models" / "qwen2_vl"
              / "video_processing_qwen2_vl.py").read_text()
    video_class = next(node for node in ast.parse(source).body
                       if isinstance(node, ast.ClassDef) and node.name == "Qwen2VLVideoProcessor")
    size_node = next(item.value for item in video_class.body if isinstance(item, ast.Assign)
                     and getattr(item.targets[0], "id", None) == "size")
    assert eval(compile(ast.Expression(size_node), "size", "eval"), {"__builtins__": {}}) == pf.VIDEO_SIZE_DEFAULT


def test_a_processor_folder_that_does_not_exist_is_called_so(tmp_path):
    from flexrl_ds.media.processor_files import processor_settings

    with pytest.raises(ValueError, match=r"nomodel: no such directory \(a model or processor directory is needed\)"):
        processor_settings(tmp_path / "nomodel")
    with pytest.raises(ValueError, match="no preprocessor_config.json"):  # a folder, but no processor in it
        processor_settings(tmp_path)
