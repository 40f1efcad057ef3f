"""Generated video clips for `flexrl make-dataset`: a square moving over a scrolling colour gradient
(so that every frame differs), made in chunks of `CHUNK_FRAMES` and encoded as they are made, so
that a 60 s 720p clip (5 GB of raw frames) never sits in memory whole; many clips are encoded at once
in worker processes (`encode_videos`).

Encoding (media/video_encoding.py): H.264 MP4 by torchcodec (libx264, yuv420p, constant QP 23, one
encoder thread: the same frames give the same bytes; x264's default rate control or threads made other
bytes now and then, docs/notes/demo-runs-2026-12-01-to-05.md), else MPEG-4 part 2 by OpenCV.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flexrl_ds.media.video_encoding import encode_video_chunks

CHUNK_FRAMES = 32
"""Frames generated and handed to the encoder at a time."""


@dataclass(frozen=True)
class VideoJob:
    """One clip to write."""

    path: str
    """Output .mp4 file."""
    num_frames: int
    width: int
    """Even (H.264 4:2:0)."""
    height: int
    """Even (H.264 4:2:0)."""
    fps: float
    seed: int
    """Seeds the square's colour."""

    @property
    def pixel_frames(self) -> int:
        """Pixels over all frames: the clip's share of the encoding work."""
        return self.num_frames * self.width * self.height


def frame_chunks(num_frames: int, width: int, height: int, seed: int = 0,
                 chunk: int = CHUNK_FRAMES) -> Iterator[torch.Tensor]:
    """The clip's frames in order, as uint8 (n <= chunk, 3, height, width) tensors."""
    generator = np.random.default_rng(seed)
    colour = torch.tensor(generator.integers(40, 255, 3), dtype=torch.uint8).view(3, 1, 1)
    ys = torch.linspace(0, 1, height).view(height, 1).expand(height, width)
    xs = torch.linspace(0, 1, width).view(1, width).expand(height, width)
    base = torch.stack([xs, ys, (xs + ys) / 2]) * 0.5 + 0.5 * torch.sin(6.28 * (xs + 2 * ys)) ** 2
    base = (255 * base).to(torch.uint8)  # (3, H, W)
    side = max(2, min(width, height) // 4)
    step = max(1, width // 40)
    for first in range(0, num_frames, chunk):
        frames = torch.empty(min(chunk, num_frames - first), 3, height, width, dtype=torch.uint8)
        for offset in range(frames.shape[0]):
            index = first + offset
            frames[offset] = torch.roll(base, shifts=index * step, dims=2)
            x0 = int((width - side) * index / max(1, num_frames - 1))
            y0 = int((height - side) * (0.5 + 0.4 * np.sin(index / 3)))
            frames[offset, :, y0:y0 + side, x0:x0 + side] = colour
        yield frames


def video_frames(num_frames: int, width: int, height: int, seed: int = 0) -> torch.Tensor:
    """uint8 (num_frames, 3, height, width): the whole clip of `frame_chunks` at once."""
    return torch.cat(list(frame_chunks(num_frames, width, height, seed)))


def write_video(path: str | Path, num_frames: int, width: int, height: int, fps: float, seed: int = 0) -> None:
    """Encode a generated clip as H.264 MP4 with torchcodec; where torchcodec cannot load, as
    MPEG-4 part 2 MP4 with OpenCV. Width and height must be even."""
    if width % 2 or height % 2:
        raise ValueError(f"H.264 4:2:0 needs even sides, got {width}x{height}")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    encode_video_chunks(path, frame_chunks(num_frames, width, height, seed), width, height, fps, codec="libx264",
                        pixel_format="yuv420p", preset="veryfast", extra_options={"qp": 23, "threads": 1})


def write_job(job: VideoJob) -> VideoJob:
    """`write_video` of one job (what a worker process runs)."""
    write_video(job.path, job.num_frames, job.width, job.height, job.fps, job.seed)
    return job


def available_cpus() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def encode_videos(jobs: Sequence[VideoJob], workers: int,
                  done: Callable[[VideoJob], None] | None = None) -> None:
    """Write every job: in this process with `workers` <= 1, else in that many worker processes
    (spawned: the parent's threads stay out of them), the largest clips first so that the workers
    finish together. `done(job)` is called here as each clip is written."""
    report = done or (lambda job: None)
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            report(write_job(job))
        return
    ordered = sorted(jobs, key=lambda job: -job.pixel_frames)
    pool = ProcessPoolExecutor(max_workers=min(workers, len(jobs)), initializer=_one_thread,
                               mp_context=multiprocessing.get_context("spawn"))
    try:
        pending = {pool.submit(write_job, job) for job in ordered}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                report(future.result())  # a worker's error is raised here, as the worker raised it
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _one_thread() -> None:
    """A worker process encodes one clip at a time on one core (so do torch and OpenCV in it)."""
    torch.set_num_threads(1)
    try:
        import cv2

        cv2.setNumThreads(1)
    except ImportError:
        pass
