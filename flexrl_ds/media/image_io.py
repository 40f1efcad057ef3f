"""Pixel operations of the Qwen2-VL processors: image loading, resize, normalise, patchify.

Each step reproduces what the Hugging Face processor does, so the tensors are the model's inputs:
- `load_image_rgb`: PIL decode to RGB uint8 (3, H, W), transparency handled as the installed
  transformers does (`hf_transparency_policy`: composited onto white, or alpha dropped).
- `resize_pil`: PIL bicubic on uint8, as transformers' PIL image backend.
- `resize_torch`: antialiased bicubic `interpolate` on uint8 tensors, as transformers' torchvision
  backend (and its video processor) on CPU.
- `normalize`: x * rescale_factor (1/255), then (x - mean) / std (unless do_normalize is off), float32.
- `patchify`: (frames, 3, H, W) -> (groups * H/p * W/p, 3 * T * p * p) rows in the merge-window
  order the vision tower expects; the last frame is repeated to fill a temporal group.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F


TRANSPARENCY_POLICIES = ("white", "drop")


def load_image_rgb(path: str, transparency: str = "auto") -> torch.Tensor:
    """Decode an image file to RGB uint8 (3, H, W); raises ValueError if it cannot be decoded.

    `transparency` (images with an alpha band or a transparency colour): "white" composites onto
    white; "drop" is PIL's `convert("RGB")` (alpha ignored, the colour under transparent pixels
    kept); "auto" does what the installed transformers' image processors do (`hf_transparency_policy`).
    """
    from PIL import Image

    if transparency not in ("auto",) + TRANSPARENCY_POLICIES:
        raise ValueError(f"transparency: {transparency!r} is not one of auto, {', '.join(TRANSPARENCY_POLICIES)}")
    try:
        with Image.open(path) as image:
            image.load()
            rgb = _to_rgb(image, transparency)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as error:
        raise ValueError(f"cannot decode image ({error})") from None
    return torch.from_numpy(np.asarray(rgb, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()


def _to_rgb(image, transparency: str):
    from PIL import Image

    if "A" not in image.getbands() and image.info.get("transparency") is None:
        return image.convert("RGB")
    if transparency == "auto":
        transparency = hf_transparency_policy()
    if transparency == "drop":
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


@functools.lru_cache(maxsize=None)
def hf_transparency_policy() -> str:
    """How the installed transformers turns a transparent image into RGB: "white" (5.24: composited
    onto white) or "drop" (5.17, 5.18: PIL `convert("RGB")`). Found by running its
    `image_transforms.convert_to_rgb` - what both image backends (PIL, torchvision) call on a PIL
    image in those releases - on one transparent pixel, so it follows the release installed. Runs
    only when a transparent image appears; costs importing that module (~1 s CPU)."""
    import inspect

    import transformers
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb

    transparent = Image.new("RGBA", (1, 1), (10, 20, 30, 0))
    takes_return_numpy = "return_numpy" in inspect.signature(convert_to_rgb).parameters
    converted = convert_to_rgb(transparent, return_numpy=True) if takes_return_numpy else convert_to_rgb(transparent)
    pixel = tuple(int(value) for value in np.asarray(converted).reshape(-1))
    if pixel == (255, 255, 255):
        return "white"
    if pixel == (10, 20, 30):
        return "drop"
    raise RuntimeError(f"transformers {transformers.__version__} converts a transparent (10, 20, 30) pixel to "
                       f"{pixel}: neither white compositing nor dropping alpha, which ShadowLoader reproduces")


def resize_pil(frames_NCHW: torch.Tensor, size_hw: tuple[int, int]) -> torch.Tensor:
    """PIL bicubic resize of uint8 frames to (height, width)."""
    from PIL import Image

    if tuple(frames_NCHW.shape[-2:]) == tuple(size_hw):
        return frames_NCHW
    height, width = size_hw
    resized = []
    for frame in frames_NCHW:
        image = Image.fromarray(frame.permute(1, 2, 0).numpy())
        array = np.asarray(image.resize((width, height), resample=Image.Resampling.BICUBIC))
        resized.append(torch.from_numpy(array.copy()).permute(2, 0, 1))
    return torch.stack(resized)


def resize_torch(frames_NCHW: torch.Tensor, size_hw: tuple[int, int]) -> torch.Tensor:
    """Antialiased bicubic resize of uint8 frames to (height, width), staying in uint8."""
    if tuple(frames_NCHW.shape[-2:]) == tuple(size_hw):
        return frames_NCHW
    return F.interpolate(frames_NCHW, size=list(size_hw), mode="bicubic", align_corners=False, antialias=True)


def resize(frames_NCHW: torch.Tensor, size_hw: tuple[int, int], impl: str) -> torch.Tensor:
    if impl == "pil":
        return resize_pil(frames_NCHW, size_hw)
    assert impl == "torch", impl
    return resize_torch(frames_NCHW, size_hw)


@functools.lru_cache(maxsize=None)
def torchvision_importable() -> bool:
    """Whether transformers would use its torchvision backend here (then `auto` resizes with torch)."""
    try:
        import torchvision.transforms.v2.functional  # noqa: F401
    except Exception:
        return False
    return True


def normalize(frames_NCHW: torch.Tensor, mean: list[float], std: list[float], rescale_factor: float = 1 / 255,
              do_normalize: bool = True) -> torch.Tensor:
    """uint8 -> float32 times `rescale_factor` (1/255: [0, 1]), then standardised per channel
    unless `do_normalize` is false (HF `rescale` then `normalize`)."""
    scaled = frames_NCHW.to(torch.float32) * rescale_factor
    if not do_normalize:
        return scaled
    mean_t = torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1)
    std_t = torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1)
    return (scaled - mean_t) / std_t


def patchify(frames_NCHW: torch.Tensor, patch_size: int, merge_size: int, temporal_patch_size: int) -> torch.Tensor:
    """Normalised frames (N, 3, H, W) -> rows (ceil(N/T) * H/p * W/p, 3*T*p*p)."""
    num_frames, channels, height, width = frames_NCHW.shape
    pad = -num_frames % temporal_patch_size
    if pad:
        frames_NCHW = torch.cat([frames_NCHW, frames_NCHW[-1:].expand(pad, -1, -1, -1)])
    num_groups = frames_NCHW.shape[0] // temporal_patch_size
    grid_h, grid_w = height // patch_size, width // patch_size
    blocks = frames_NCHW.reshape(
        num_groups, temporal_patch_size, channels,
        grid_h // merge_size, merge_size, patch_size,
        grid_w // merge_size, merge_size, patch_size,
    )
    # -> groups, merge rows, merge cols, row in window, col in window, channel, frame, py, px
    blocks = blocks.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return blocks.reshape(num_groups * grid_h * grid_w, channels * temporal_patch_size * patch_size * patch_size)


def unpatchify(rows: torch.Tensor, grid_thw, patch_size: int, merge_size: int,
               temporal_patch_size: int) -> torch.Tensor:
    """`patchify` undone: rows (t*h*w, 3*T*p*p) of grid (t, h, w) -> frames (t*T, 3, h*p, w*p)."""
    t, h, w = (int(v) for v in grid_thw)
    p, m, T = patch_size, merge_size, temporal_patch_size
    if rows.shape != (t * h * w, 3 * T * p * p):
        raise ValueError(f"pixel rows {tuple(rows.shape)} do not match grid {tuple(grid_thw)} "
                         f"(expected {(t * h * w, 3 * T * p * p)})")
    blocks = rows.reshape(t, h // m, w // m, m, m, 3, T, p, p)
    # groups, merge rows, merge cols, row in window, col in window, channel, frame, py, px ->
    # groups, frame, channel, merge rows, row in window, py, merge cols, col in window, px
    return blocks.permute(0, 6, 5, 1, 3, 7, 2, 4, 8).reshape(t * T, 3, h * p, w * p)


def denormalize(frames_NCHW: torch.Tensor, mean: list[float], std: list[float], rescale_factor: float = 1 / 255,
                do_normalize: bool = True) -> torch.Tensor:
    """`normalize` undone: standardised frames -> uint8 pixel values (rounded)."""
    values = frames_NCHW.to(torch.float64)
    if do_normalize:
        values = values * torch.tensor(std, dtype=torch.float64).view(1, 3, 1, 1) \
            + torch.tensor(mean, dtype=torch.float64).view(1, 3, 1, 1)
    return (values / rescale_factor).round().clamp(0, 255).to(torch.uint8)
