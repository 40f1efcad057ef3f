"""SamplePreprocessor against the Hugging Face Qwen2-VL processors, and predicted == actual shapes.

References:
- images: transformers' `Qwen2VLImageProcessorPil` (the image processor transformers uses when
  torchvision is absent, as here), called on the file through its public API;
- videos: the full `Qwen2VLVideoProcessor` where torchvision is importable (GPU machine); here, the
  same pipeline assembled from transformers' own pieces - its `sample_frames` and `patchify` (from
  its source), `smart_resize`, `rescale`/`normalize` - around frames decoded directly with
  torchcodec and resized like torchvision's tensor resize (antialiased bicubic interpolate on uint8).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.image_transforms import normalize as hf_normalize
from transformers.image_transforms import rescale as hf_rescale
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

from flexrl_ds.data.config import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, DataConfig
from flexrl_ds.data.image_io import resize_pil, resize_torch
from flexrl_ds.data.preprocess import SamplePreprocessor, collate
from flexrl_ds.data.types import MediaItem, Record, SampleMeta

CONFIG = DataConfig(image_min_pixels=28 * 28 * 4, image_max_pixels=28 * 28 * 64,
                    video_min_pixels=28 * 28 * 4, video_max_pixels=28 * 28 * 24,
                    video_min_frames=4, video_max_frames=12, resize_impl="pil")


def record_of(*paths, kind_of=None, **options) -> Record:
    items = tuple(MediaItem("video" if str(p).endswith(".mp4") else "image", str(p), source=str(p), **options)
                  for p in paths)
    markers = "".join(f"<{item.kind}>" for item in items)
    return Record(id="r", prompt=markers + "q", items=items)


def test_images_equal_hf_image_processor(media):
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    hf = Qwen2VLImageProcessorPil(min_pixels=CONFIG.image_min_pixels, max_pixels=CONFIG.image_max_pixels)
    preprocessor = SamplePreprocessor(CONFIG)
    for path in media.images:
        meta, outputs = preprocessor.process(record_of(path))
        with Image.open(path) as image:
            expected = hf(images=[image], return_tensors="pt")
        assert torch.equal(outputs["image_grid_thw"], expected["image_grid_thw"]), path.name
        torch.testing.assert_close(outputs["pixel_values"], expected["pixel_values"], atol=1e-5, rtol=0)


def test_images_equal_hf_torchvision_image_processor_where_torchvision_exists(media):
    pytest.importorskip("torchvision", reason="transformers' torchvision image backend needs torchvision")
    from PIL import Image
    from transformers import Qwen2VLImageProcessor

    hf = Qwen2VLImageProcessor(min_pixels=CONFIG.image_min_pixels, max_pixels=CONFIG.image_max_pixels)
    preprocessor = SamplePreprocessor(DataConfig(**{**CONFIG.__dict__, "resize_impl": "auto"}))
    assert preprocessor.image_resize_impl == "torch"
    for path in media.images:
        meta, outputs = preprocessor.process(record_of(path))
        with Image.open(path) as image:
            expected = hf(images=[image], return_tensors="pt")
        assert torch.equal(outputs["image_grid_thw"], expected["image_grid_thw"]), path.name
        torch.testing.assert_close(outputs["pixel_values"], expected["pixel_values"], atol=1e-5, rtol=0)


def test_several_images_in_one_sample_equal_hf_batch(media):
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    hf = Qwen2VLImageProcessorPil(min_pixels=CONFIG.image_min_pixels, max_pixels=CONFIG.image_max_pixels)
    paths = media.images[:3]
    meta, outputs = SamplePreprocessor(CONFIG).process(record_of(*paths))
    expected = hf(images=[Image.open(p) for p in paths], return_tensors="pt")
    assert torch.equal(outputs["image_grid_thw"], expected["image_grid_thw"])
    torch.testing.assert_close(outputs["pixel_values"], expected["pixel_values"], atol=1e-5, rtol=0)


def reference_video(path, hf_video_functions, config: DataConfig, fps=None):
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
    normalised = [hf_normalize(hf_rescale(frame.numpy(), 1 / 255), OPENAI_CLIP_MEAN, OPENAI_CLIP_STD,
                               input_data_format="channels_first") for frame in resized]
    videos = torch.from_numpy(np.stack(normalised)).float().unsqueeze(0)
    patches, grid_t, grid_h, grid_w = hf_video_functions.patchify(videos)
    return indices, patches[0], (grid_t, grid_h, grid_w)


def test_videos_equal_hf_video_pipeline(media, hf_video_functions):
    preprocessor = SamplePreprocessor(CONFIG)
    for path in media.videos:
        meta, outputs = preprocessor.process(record_of(path))
        indices, patches, grid = reference_video(path, hf_video_functions, CONFIG)
        assert list(meta.items[0].frame_indices) == indices, path.name
        assert outputs["video_grid_thw"].tolist() == [list(grid)], path.name
        torch.testing.assert_close(outputs["pixel_values_videos"], patches, atol=1e-5, rtol=0)


def test_videos_equal_hf_video_processor_where_torchvision_exists(media):
    pytest.importorskip("torchvision", reason="transformers' Qwen2-VL video processor needs torchvision")
    from transformers import Qwen2VLVideoProcessor

    from flexrl_ds.data.video_backends import get_video_backend

    hf = Qwen2VLVideoProcessor(min_pixels=CONFIG.video_min_pixels, max_pixels=CONFIG.video_max_pixels,
                               min_frames=CONFIG.video_min_frames, max_frames=CONFIG.video_max_frames)
    preprocessor = SamplePreprocessor(CONFIG)
    backend = get_video_backend("auto")
    for path in media.videos:
        meta, outputs = preprocessor.process(record_of(path))
        info = backend.probe(str(path))
        frames = backend.decode(str(path), list(range(info.num_frames)))  # HF samples from all frames
        metadata = {"total_num_frames": info.num_frames, "fps": info.fps, "duration": info.duration,
                    "height": info.height, "width": info.width}
        expected = hf(videos=[frames], video_metadata=[metadata], do_sample_frames=True, fps=CONFIG.video_fps,
                      cap_pixels_per_frame=False, return_tensors="pt")
        assert torch.equal(outputs["video_grid_thw"], expected["video_grid_thw"]), path.name
        torch.testing.assert_close(outputs["pixel_values_videos"], expected["pixel_values_videos"], atol=1e-5, rtol=0)


def test_torch_resize_close_to_pil_resize():
    frames = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (2, 3, 97, 131), dtype=np.uint8))
    for size in ((56, 84), (196, 252), (28, 28)):
        difference = (resize_torch(frames, size).int() - resize_pil(frames, size).int()).abs()
        assert difference.float().mean() < 1.0 and difference.max() <= 8, size


def test_predicted_shapes_equal_materialised_shapes_everywhere(media):
    preprocessor = SamplePreprocessor(CONFIG)
    for paths in ([p] for p in media.images + media.videos):
        meta, outputs = preprocessor.process(record_of(*paths))
        actual = {key: tuple(value.shape) for key, value in outputs.items() if isinstance(value, torch.Tensor)}
        assert actual == meta.predicted_shapes(), paths
    mixed = [media.images[0], media.videos[1], media.images[3], media.videos[0]]
    meta, outputs = preprocessor.process(record_of(*mixed))
    actual = {key: tuple(value.shape) for key, value in outputs.items() if isinstance(value, torch.Tensor)}
    assert actual == meta.predicted_shapes()
    assert meta.vision_tokens == sum(item.vision_tokens for item in meta.items) > 0


def test_placeholder_slices_materialise_to_the_same_rows(media):
    preprocessor = SamplePreprocessor(CONFIG)
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


def test_tiny_model_processor_dir_sets_geometry(tmp_path, media):
    tiny = pytest.importorskip("flexrl_ds.models.tiny")
    import json

    config = tiny.TinyModelConfig(out_dir=str(tmp_path))
    for name, content in tiny.processor_configs(config).items():
        (tmp_path / name).write_text(json.dumps(content))
    data_config = DataConfig().with_processor_dir(tmp_path)
    assert (data_config.image_min_pixels, data_config.image_max_pixels) == (config.min_pixels, config.max_pixels)
    assert (data_config.video_min_pixels, data_config.video_max_pixels) == (config.min_pixels, config.max_pixels)
    from PIL import Image
    from transformers import AutoImageProcessor

    hf = AutoImageProcessor.from_pretrained(tmp_path)  # the backend transformers picks here (PIL without torchvision)
    meta, outputs = SamplePreprocessor(data_config).process(record_of(media.images[0]))
    expected = hf(images=[Image.open(media.images[0])], return_tensors="pt")
    torch.testing.assert_close(outputs["pixel_values"], expected["pixel_values"], atol=1e-5, rtol=0)


def test_video_where_hf_sampling_runs_past_the_end(tmp_path):
    """185 frames at 8 fps sampled at 2 fps: HF's float32 positions are 47, the last one 185 (past
    the end, HF's own decode fails); ours are the other 46, and the sample decodes fine."""
    from flexrl_ds.bench.datasets import write_video

    path = tmp_path / "v185.mp4"
    write_video(path, 185, 32, 24, 8)
    config = DataConfig(**{**CONFIG.__dict__, "video_max_frames": 768})
    meta, outputs = SamplePreprocessor(config).process(record_of(path))
    assert len(meta.items[0].frame_indices) == 46 and meta.items[0].frame_indices[-1] == 180
    assert meta.items[0].grid_thw[0] == 23
    actual = {key: tuple(value.shape) for key, value in outputs.items() if isinstance(value, torch.Tensor)}
    assert actual == meta.predicted_shapes()
