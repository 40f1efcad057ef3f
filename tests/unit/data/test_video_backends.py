"""torchcodec and OpenCV backends: same metadata, same frames chosen, same shapes, close pixels."""

from __future__ import annotations

import pytest
import torch

from flexrl_ds.media.config import MediaConfig
from flexrl_ds.media.preprocess import SamplePreprocessor
from flexrl_ds.media.types import MediaItem, Record
from flexrl_ds.media.video_backends import available_backends, get_video_backend

pytestmark = pytest.mark.skipif(
    set(available_backends()) != {"torchcodec", "opencv"}, reason="needs both torchcodec and OpenCV"
)
CONFIG = MediaConfig(video_min_pixels=28 * 28 * 4, video_max_pixels=28 * 28 * 24, video_max_frames=16)


def test_both_backends_probe_the_same_metadata(media):
    torchcodec, opencv = get_video_backend("torchcodec"), get_video_backend("opencv")
    for path in media.videos:
        a, b = torchcodec.probe(str(path)), opencv.probe(str(path))
        assert (a.width, a.height, a.num_frames) == (b.width, b.height, b.num_frames), path.name
        assert a.fps == pytest.approx(b.fps, rel=1e-6), path.name


def test_both_backends_decode_the_same_frames(media):
    torchcodec, opencv = get_video_backend("torchcodec"), get_video_backend("opencv")
    for path in media.videos:
        num_frames = torchcodec.probe(str(path)).num_frames
        indices = [num_frames - 1, 0, num_frames // 2, num_frames // 2]  # any order, repeats
        a, b = torchcodec.decode(str(path), indices), opencv.decode(str(path), indices)
        assert a.shape == b.shape and a.dtype == b.dtype == torch.uint8
        difference = (a.int() - b.int()).abs().float()
        assert difference.mean() < 2.0 and difference.quantile(0.99) <= 8, path.name
        # a different frame is much further away than the other decoder's copy of the same frame
        assert (a[0].int() - b[1].int()).abs().float().mean() > 3 * difference.mean() + 1


def test_preprocessing_agrees_across_backends(media):
    outputs = {}
    for backend in ("torchcodec", "opencv"):
        preprocessor = SamplePreprocessor(MediaConfig(**{**CONFIG.__dict__, "video_backend": backend}))
        for path in media.videos:
            record = Record(id=path.name, prompt="<video>", items=(MediaItem("video", str(path)),))
            meta, tensors = preprocessor.process(record)
            outputs[backend, path.name] = (meta.items[0].frame_indices, tensors)
    for path in media.videos:
        (indices_a, a), (indices_b, b) = outputs["torchcodec", path.name], outputs["opencv", path.name]
        assert indices_a == indices_b
        assert torch.equal(a["video_grid_thw"], b["video_grid_thw"])
        difference = (a["pixel_values_videos"] - b["pixel_values_videos"]).abs()
        assert difference.mean() < 0.05, path.name  # normalised units: 0.05 is about 3/255


def test_backend_selection():
    assert get_video_backend("auto").name == available_backends()[0] == "torchcodec"
    with pytest.raises(ValueError, match="unknown video backend"):
        get_video_backend("decord")
