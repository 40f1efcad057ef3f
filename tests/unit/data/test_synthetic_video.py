"""Generated clips (bench/synthetic_video.py) and `make-dataset --scale nextqa`: clips made in chunks
decode to the frames generated, through torchcodec's encoder and through the OpenCV fallback (the GPU
machine's); NExTQA-like records have the sizes asked for. (Worker processes: tests/integration/test_data_cli.py.)"""

from __future__ import annotations

import sys

import pytest
import torch

from flexrl_ds.bench.datasets import SCALES, make_dataset, make_records
from flexrl_ds.bench.synthetic_video import CHUNK_FRAMES, frame_chunks, video_frames, write_video
from flexrl_ds.media.video_backends import available_backends, get_video_backend


def _frame_at(num_frames: int, width: int, height: int, seed: int, index: int) -> torch.Tensor:
    """Frame `index` from one-frame chunks: the generator's own arithmetic, frame by frame."""
    return list(frame_chunks(num_frames, width, height, seed, chunk=1))[index][0]


def test_chunks_give_the_frames_of_one_frame_at_a_time():
    frames = video_frames(2 * CHUNK_FRAMES + 5, 48, 32, seed=4)
    assert frames.shape == (2 * CHUNK_FRAMES + 5, 3, 32, 48) and frames.dtype == torch.uint8
    for index in (0, CHUNK_FRAMES - 1, CHUNK_FRAMES, 2 * CHUNK_FRAMES + 4):
        assert torch.equal(frames[index], _frame_at(len(frames), 48, 32, 4, index))
    assert not torch.equal(frames[0], frames[1])  # the clip moves


def _decoded_close(path, frames: torch.Tensor) -> None:
    for name in available_backends():
        backend = get_video_backend(name)
        info = backend.probe(str(path))
        assert (info.num_frames, info.width, info.height) == (len(frames), frames.shape[-1], frames.shape[-2]), name
        indices = [0, CHUNK_FRAMES - 1, CHUNK_FRAMES, len(frames) - 1]
        difference = (backend.decode(str(path), indices).int() - frames[indices].int()).abs().float()
        assert difference.mean() < 12, name  # lossy, but the same pictures
        other = (frames[indices[0]].int() - frames[indices[-1]].int()).abs().float().mean()
        assert other > 2 * difference.mean(), name


@pytest.mark.skipif("torchcodec" not in available_backends(), reason="needs torchcodec")
def test_a_clip_longer_than_a_chunk_encodes_every_frame_with_torchcodec(tmp_path):
    num_frames = 2 * CHUNK_FRAMES + 6
    write_video(tmp_path / "a.mp4", num_frames, 64, 48, 30.0, seed=2)
    write_video(tmp_path / "b.mp4", num_frames, 64, 48, 30.0, seed=2)
    assert (tmp_path / "a.mp4").read_bytes() == (tmp_path / "b.mp4").read_bytes()
    assert get_video_backend("torchcodec").probe(str(tmp_path / "a.mp4")).fps == pytest.approx(30.0)
    _decoded_close(tmp_path / "a.mp4", video_frames(num_frames, 64, 48, seed=2))


def test_without_torchcodec_opencv_writes_the_clip(tmp_path, monkeypatch):
    pytest.importorskip("cv2")
    monkeypatch.setitem(sys.modules, "torchcodec.encoders", None)  # the GPU machine: no FFmpeg libraries
    num_frames = CHUNK_FRAMES + 9
    write_video(tmp_path / "cv.mp4", num_frames, 80, 60, 30.0, seed=3)
    monkeypatch.undo()
    _decoded_close(tmp_path / "cv.mp4", video_frames(num_frames, 80, 60, seed=3))


def test_nextqa_records_have_nextqa_sized_clips(tmp_path):
    rows, jobs = make_records(tmp_path, "only-video", 40, "nextqa", seed=1, task="keyword")
    assert len(rows) == len(jobs) == 40 and not list((tmp_path / "media" / "vid").iterdir())  # none encoded yet
    for row, job in zip(rows, jobs):
        assert str(tmp_path / row["videos"][0]) == job.path and job.fps == 30
        seconds = job.num_frames / job.fps
        assert 20.0 <= seconds <= 60.0 + 1 / 30, row["id"]
        assert 640 <= job.width <= 1280 and 360 <= job.height <= 720 and job.width % 2 == job.height % 2 == 0
    sizes = {(job.width, job.height) for job in jobs}
    assert max(w * h for w, h in sizes) > 3 * min(w * h for w, h in sizes)  # 360p to 720p, not one size
    assert SCALES["nextqa"].video_fps == 30


def test_make_dataset_reports_progress_over_records(tmp_path):
    calls: list[tuple[int, int]] = []
    summary = make_dataset(tmp_path, "video-heavy", 5, "small", seed=2, progress=lambda d, t: calls.append((d, t)))
    assert summary.num_records == 5 and calls[-1] == (5, 5)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls) and len(calls) == summary.num_videos + 1
    with pytest.raises(ValueError, match="--workers"):
        make_dataset(tmp_path / "w", "video-heavy", 2, "small", workers=0)


def test_the_cli_offers_every_scale():
    from flexrl_ds.cli.main import build_parser

    for scale in SCALES:
        args = build_parser().parse_args(["make-dataset", "--mix", "video-heavy", "--num", "1", "--scale", scale,
                                          "--out", "x", "--workers", "3"])
        assert (args.scale, args.workers) == (scale, 3)
