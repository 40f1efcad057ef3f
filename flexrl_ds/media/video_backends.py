"""Video decoding backends: torchcodec (default) and OpenCV (where torchcodec or FFmpeg's shared
libraries are missing, e.g. the GPU machine).

A backend does two things: `probe(path)` reads the container's metadata (frame count, fps,
duration, size) without decoding frames, and `decode(path, frame_indices)` returns exactly those
frames as an RGB uint8 tensor of shape (N, 3, H, W). Frame selection is not the backend's business
(vision_geometry decides it from metadata), so both backends decode the same frames and produce the
same shapes; pixels may differ slightly through the decoders' YUV->RGB conversion.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from flexrl_ds.media.types import MediaInfo


class VideoBackend(Protocol):
    name: str

    def probe(self, path: str) -> MediaInfo:
        """Container metadata; raises ValueError when the file is not a readable video."""

    def decode(self, path: str, frame_indices: Sequence[int]) -> torch.Tensor:
        """Frames at `frame_indices` (any order, repeats allowed) as uint8 (N, 3, H, W) RGB;
        raises ValueError when they cannot be decoded."""


class TorchcodecBackend:
    """FFmpeg through torchcodec. Probing uses the exact-seek index (a demux scan, no decoding)."""

    name = "torchcodec"
    install_hint = "install torchcodec (CPU build 0.13) with FFmpeg's shared libraries"

    def __init__(self, num_threads: int = 1):
        from torchcodec.decoders import VideoDecoder  # raises if FFmpeg's libraries are missing

        self._decoder_class = VideoDecoder
        self.num_threads = num_threads

    def _open(self, path: str):
        try:
            return self._decoder_class(path, seek_mode="exact", num_ffmpeg_threads=self.num_threads)
        except Exception as error:  # torchcodec raises RuntimeError/ValueError for unreadable files
            raise ValueError(f"cannot open video ({_first_line(error)})") from None

    def probe(self, path: str) -> MediaInfo:
        metadata = self._open(path).metadata
        if metadata.width is None or metadata.height is None:
            raise ValueError("video stream has no frame size")
        in_header, in_file = metadata.num_frames_from_header, metadata.num_frames_from_content
        if in_header and in_file is not None and in_file < in_header:
            raise ValueError(f"truncated video: header lists {in_header} frames, the file holds {in_file}")
        return MediaInfo(
            width=int(metadata.width), height=int(metadata.height),
            num_frames=int(metadata.num_frames or 0),
            fps=float(metadata.average_fps) if metadata.average_fps else None,
            duration=float(metadata.duration_seconds) if metadata.duration_seconds else None,
        )

    def decode(self, path: str, frame_indices: Sequence[int]) -> torch.Tensor:
        decoder = self._open(path)
        try:
            return decoder.get_frames_at(indices=list(frame_indices)).data
        except Exception as error:
            raise ValueError(f"cannot decode frames ({_first_line(error)})") from None


class OpenCVBackend:
    """FFmpeg built into OpenCV. Frame count and fps come from the container header; decoding reads
    the stream sequentially (grab without colour conversion for skipped frames), which is exact
    where seeking by frame number is not."""

    name = "opencv"
    install_hint = "install opencv-python-headless"

    def __init__(self, num_threads: int = 1) -> None:
        """`num_threads` is not used: OpenCV chooses its decoder threads itself."""
        import cv2

        self._cv2 = cv2

    def _open(self, path: str):
        capture = self._cv2.VideoCapture(path)
        if not capture.isOpened():
            capture.release()
            raise ValueError("cannot open video (OpenCV)")
        return capture

    def probe(self, path: str) -> MediaInfo:
        cv2 = self._cv2
        capture = self._open(path)
        try:
            num_frames = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
            fps = float(capture.get(cv2.CAP_PROP_FPS))
            width = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH))
            height = int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        finally:
            capture.release()
        if width <= 0 or height <= 0:
            raise ValueError("video stream has no frame size")
        return MediaInfo(width=width, height=height, num_frames=max(num_frames, 0),
                         fps=fps if fps > 0 else None,
                         duration=num_frames / fps if fps > 0 else None)

    def decode(self, path: str, frame_indices: Sequence[int]) -> torch.Tensor:
        cv2 = self._cv2
        wanted = sorted(set(frame_indices))
        frames: dict[int, torch.Tensor] = {}
        capture = self._open(path)
        try:
            position = 0
            for index in wanted:
                while position < index:
                    if not capture.grab():
                        raise ValueError(f"video ended at frame {position}, before frame {index}")
                    position += 1
                ok, frame_bgr = capture.read()
                if not ok:
                    raise ValueError(f"cannot decode frame {index}")
                position += 1
                frames[index] = torch.from_numpy(cv2.cvtColor(frame_bgr, cv2.COLOR_BGR2RGB)).permute(2, 0, 1)
        finally:
            capture.release()
        return torch.stack([frames[index] for index in frame_indices]).contiguous()


def _first_line(error: Exception) -> str:
    """The first line of a decoder error, without C++ source locations."""
    lines = str(error).strip().splitlines()
    if not lines:
        return type(error).__name__
    text = re.sub(r"\(?\w+, \S+\.(?:cpp|h):\d+, ", "", lines[0])
    return text[:200]


VIDEO_BACKENDS: dict[str, Any] = {backend.name: backend for backend in (TorchcodecBackend, OpenCVBackend)}
"""The video backends by name, in the order `auto` tries them. A backend class has a `name`, an
`install_hint` and `__init__(num_threads)`, raising ImportError (or torchcodec's RuntimeError) where
its decoder's libraries are missing. A new backend is one class above and one entry here (the names
`flexrl.data.video_backend` accepts, `media.config.VIDEO_BACKENDS`, are checked against this by a
test, so that loading a config stays torch-free)."""


@functools.lru_cache(maxsize=None)
def available_backends() -> tuple[str, ...]:
    """Names of the backends that can be constructed here, in preference order."""
    names = []
    for name, backend in VIDEO_BACKENDS.items():
        try:
            backend()
        except Exception:  # ImportError, or torchcodec's RuntimeError when FFmpeg libs are absent
            continue
        names.append(name)
    return tuple(names)


def get_video_backend(name: str = "auto", num_threads: int = 1) -> VideoBackend:
    """The named backend (`VIDEO_BACKENDS`), or for `auto` the first available one;
    `num_threads` is torchcodec's FFmpeg thread count (0: FFmpeg decides)."""
    if name == "auto":
        names = available_backends()
        if not names:
            hints = "; ".join(backend.install_hint for backend in VIDEO_BACKENDS.values())
            raise ValueError(f"no video backend available: {hints}")
        name = names[0]
    if name not in VIDEO_BACKENDS:
        raise ValueError(f"unknown video backend {name!r} ({', '.join(VIDEO_BACKENDS)} or auto)")
    backend = VIDEO_BACKENDS[name]
    try:
        return backend(num_threads=num_threads)
    except Exception as error:  # ImportError, or torchcodec's RuntimeError when FFmpeg libs are absent
        raise ValueError(f"video backend {name!r} unavailable ({_first_line(error)}): {backend.install_hint}") from None
