"""The vLLM backend's pure parts: rollout requests as vLLM prompts, vLLM outputs as rollout results.

Nothing here imports vLLM, so the CPU tests cover it. `vllm_engine.py` feeds these dicts to
`vllm.LLM.generate` (a `TokensPrompt` is a plain dict) and `vllm.SamplingParams(**kwargs)`.

How a request becomes a vLLM prompt, so that vLLM makes exactly the ShadowLoader's vision grids:
- vLLM expands each vision pad of a token prompt itself (one `<|image_pad|>` per image becomes its
  merged tokens), so every run of pads in the trainer's expanded `prompt_ids` is collapsed to one pad.
  The engine afterwards checks that vLLM's expanded prompt equals the trainer's token for token: the
  same `image_grid_thw` / `video_grid_thw`, hence the same vision tokens, or a ValueError naming the
  sample (`check_expanded_prompt`).
- The pixels are the ShadowLoader's own: each item's patch rows are un-patchified and un-normalised
  back to the resized frames (uint8, rounded), so vLLM's HF processor resizes nothing. Its size
  bounds are set per prompt to contain every item's pixel count (smart_resize is then the identity),
  and each video's metadata (fps = temporal_patch_size / second_per_grid_t) gives vLLM the
  ShadowLoader's video timing (the mRoPE temporal positions).
- Qwen3-VL (checked against vLLM 0.26.0's `models/qwen3_vl.py` with transformers 5.17): each video's
  frame groups are collapsed to a bare `<|video_pad|>`, which vLLM replaces by the groups again (each
  timestamp encoded on its own, from the `(frames, metadata)` item's `frames_indices` and `fps`, with
  `do_sample_frames` off); the metadata travels only with the frames.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from flexrl_ds.families import family_for
from flexrl_ds.families.qwen2_5_vl import QWEN2_5_VL
from flexrl_ds.media import image_io
from flexrl_ds.models.processing import VisionItem
from flexrl_ds.rollout.base import RolloutRequest, RolloutResult, SamplingParams

LOGIT_BIAS_FLOOR = -100.0
"""vLLM clamps logit biases to [-100, 100]: a suppressed token's logit drops by 100 (never sampled)."""


@dataclass(frozen=True)
class PixelGeometry:
    """How the ShadowLoader turned frames into patch rows (media.config.MediaConfig's pixel part)."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    image_mean: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
    image_std: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    pin_frame_cap: bool = False
    """Pass `cap_pixels_per_frame=False` with videos: the frames given are final (any per-video cap
    was applied by the ShadowLoader), so the processor must not shrink them again whatever its
    default. Set where the installed transformers knows the keyword."""
    family: str = "qwen2_5_vl"
    """The model family's `model_type` (flexrl_ds/families/): its video metadata and size bounds."""
    bare_video_pad: bool = False
    """A timestamped video (Qwen3-VL) is collapsed to a bare `<|video_pad|>`, not to the chat template's
    `<|vision_start|><|video_pad|><|vision_end|>`: what vLLM's Qwen3-VL replaces by the frame groups
    where the installed transformers' processor overrides `replace_video_token` (>= 5.10;
    `vllm_replaces_bare_video_pad`)."""

    @classmethod
    def from_media_config(cls, config: Any, pin_frame_cap: bool = False,
                          bare_video_pad: bool = False) -> "PixelGeometry":
        return cls(config.patch_size, config.merge_size, config.temporal_patch_size, tuple(config.image_mean),
                   tuple(config.image_std), config.rescale_factor, config.do_normalize, pin_frame_cap,
                   config.processor_family, bare_video_pad)


@dataclass(frozen=True)
class VisionTokens:
    """The model's vision placeholder token ids (HF config image_token_id / video_token_id)."""

    image: int
    video: int
    vision_start: int = -1
    """`<|vision_start|>` (Qwen3-VL's timestamped video groups: `collapse_timestamped_videos`)."""
    vision_end: int = -1


def item_media(item: VisionItem, geometry: PixelGeometry) -> np.ndarray:
    """An item's pixels as vLLM takes them: an image (H, W, 3) or a video's frames (N, H, W, 3), uint8.

    An image was repeated over the temporal patch, so its first frame is the image; a video's last
    group may repeat its final frame (padding), which is kept: the processor pads the same way."""
    frames = image_io.unpatchify(item.pixel_values, item.grid_thw, geometry.patch_size, geometry.merge_size,
                                 geometry.temporal_patch_size)
    frames = image_io.denormalize(frames, list(geometry.image_mean), list(geometry.image_std),
                                  geometry.rescale_factor, geometry.do_normalize)
    hwc = frames.permute(0, 2, 3, 1).contiguous().numpy()
    return hwc[0] if item.kind == "image" else hwc


def collapse_vision_pads(request: RolloutRequest, tokens: VisionTokens, merge_size: int,
                         video_runs: bool = True) -> list[int]:
    """The prompt with each item's run of pad tokens collapsed to one pad (vLLM expands it again).

    Every run must be one item's merged tokens, in prompt order: else a ValueError names the sample.
    video_runs False: the videos are already collapsed to one pad each (`collapse_timestamped_videos`)."""
    kinds = {tokens.image: "image", tokens.video: "video"}
    collapsed: list[int] = []
    runs: list[tuple[str, int]] = []
    for token in request.prompt_ids:
        kind = kinds.get(token)
        if kind is not None and collapsed and collapsed[-1] == token:
            runs[-1] = (kind, runs[-1][1] + 1)
            continue
        if kind is not None:
            runs.append((kind, 1))
        collapsed.append(token)
    expected = [(item.kind, item.num_tokens(merge_size) if video_runs or item.kind == "image" else 1)
                for item in request.items]
    if runs != expected:
        raise ValueError(f"rollout request {request.sample_key!r}: vision pad runs {runs} in prompt_ids do not "
                         f"match its items {expected} (kind, merged tokens) in order")
    return collapsed


def processor_kwargs(items: Sequence[VisionItem], geometry: PixelGeometry) -> dict[str, Any]:
    """HF processor settings for one prompt under which vLLM keeps every item's size and timing.

    - `size`: bounds that contain every item's pixel count, so smart_resize keeps each size;
    - `video_metadata` (Qwen2.5-VL): each video's frames were sampled at fps = temporal_patch_size /
      second_per_grid_t (without it transformers assumes 24 fps and the mRoPE temporal positions
      differ); Qwen3-VL's travels with the frames instead (`build_prompt`);
    - `do_sample_frames` off: the frames given are the sampled ones;
    - `cap_pixels_per_frame` off (`geometry.pin_frame_cap`): nor are they to be shrunk again."""
    if not items:
        return {}
    pixels = [_bounded_pixels(item, geometry) for item in items]
    kwargs: dict[str, Any] = {"size": {"shortest_edge": min(pixels), "longest_edge": max(pixels)}}
    videos = [item for item in items if item.kind == "video"]
    if videos:
        kwargs["do_sample_frames"] = False
        if not family_for(geometry.family).prompt_timestamps:
            # Qwen3-VL's metadata travels with each video's frames (`build_prompt`): vLLM 0.26's Qwen3-VL
            # hands it to the processor as `video_metadata` itself, so a kwarg of that name would be a
            # second value for the same keyword (a TypeError in the processor call).
            kwargs["video_metadata"] = [video_metadata(item, geometry) for item in videos]
        if geometry.pin_frame_cap:
            kwargs["cap_pixels_per_frame"] = False
    return kwargs


def _bounded_pixels(item: VisionItem, geometry: PixelGeometry) -> int:
    """The pixel count the processor's size bounds apply to: a frame's, or (Qwen3-VL's videos) all frames'."""
    frame = item.grid_thw[1] * item.grid_thw[2] * geometry.patch_size ** 2
    if item.kind == "video" and family_for(geometry.family).video_budget_over_frames:
        return frame * item.grid_thw[0] * geometry.temporal_patch_size
    return frame


def video_metadata(item: VisionItem, geometry: PixelGeometry) -> dict[str, Any]:
    """transformers' VideoMetadata fields of one video, by the family (`ModelFamily.vllm_video_metadata`):
    Qwen2.5-VL's frames all sampled at fps = temporal_patch_size / second_per_grid_t (its mRoPE
    temporal positions); Qwen3-VL's source fps and source frame indices (its prompt timestamps)."""
    return family_for(geometry.family).vllm_video_metadata(item, geometry)


def collapse_timestamped_videos(request: RolloutRequest, tokens: VisionTokens, geometry: PixelGeometry,
                                encode: Callable[[str], list[int]]) -> RolloutRequest:
    """The request with each Qwen3-VL video's frame groups (`<t seconds>` + vision_start + pads +
    vision_end each) collapsed to what vLLM's Qwen3-VL replaces by the groups again, encoding each
    timestamp on its own (`encode`: the tokenizer's, without special tokens): a bare `<|video_pad|>`
    (`geometry.bare_video_pad`; vLLM 0.26 with transformers >= 5.10, whose own processor collapses the
    template's wrapper first), else the chat template's `<|vision_start|><|video_pad|><|vision_end|>`
    (older processors). A video whose groups are not exactly those tokens (a
    first timestamp merged with the text before it, as a whole-text tokenizer may do) is a ValueError
    naming the sample: vLLM would see another prompt than the trainer."""
    family = family_for(geometry.family)
    placeholder = [tokens.video] if geometry.bare_video_pad else [tokens.vision_start, tokens.video, tokens.vision_end]
    ids, out, cursor = list(request.prompt_ids), [], 0
    for index, item in enumerate(request.items):
        if item.kind != "video":
            continue
        t, h, w = item.grid_thw
        stamps = [encode(f"<{stamp:.1f} seconds>")
                  for stamp in family.group_timestamps(item, geometry.temporal_patch_size)]
        frame = [tokens.vision_start] + [tokens.video] * (h * w // geometry.merge_size ** 2) + [tokens.vision_end]
        groups = [token for stamp in stamps for token in stamp + frame]
        first_pad = ids.index(tokens.video, cursor) if tokens.video in ids[cursor:] else -1
        start = first_pad - 1 - len(stamps[0])
        if first_pad < 0 or start < cursor or ids[start:start + len(groups)] != groups:
            raise ValueError(f"rollout request {request.sample_key!r}: video {index}'s frame groups in prompt_ids are "
                             "not the timestamp and vision tokens vLLM makes of them (is the first timestamp "
                             "tokenized together with the text before it?)")
        out += ids[cursor:start] + placeholder
        cursor = start + len(groups)
    return dataclasses.replace(request, prompt_ids=out + ids[cursor:])


def vllm_replaces_bare_video_pad(family: str) -> bool:
    """Whether vLLM 0.26's Qwen3-VL replaces a bare `<|video_pad|>` by a video's frame groups (its
    `Qwen3VLMultiModalProcessor._expands_only_video_token`): so where the installed transformers'
    processor class of the family overrides `ProcessorMixin.replace_video_token` (>= 5.10)."""
    import transformers
    from transformers.processing_utils import ProcessorMixin

    model_family = family_for(family)
    if not model_family.prompt_timestamps:
        return False
    processor = getattr(transformers, model_family.processor_classes[0], None)
    base = getattr(ProcessorMixin, "replace_video_token", None)
    own = getattr(processor, "replace_video_token", None)
    return own is not None and own is not base


def build_prompt(request: RolloutRequest, tokens: VisionTokens, geometry: PixelGeometry,
                 encode: Callable[[str], list[int]] | None = None) -> dict[str, Any]:
    """A vLLM `TokensPrompt` (a dict) for one request. `encode`: the tokenizer's (text -> ids), needed
    for a family with prompt timestamps (Qwen3-VL), whose videos also carry their metadata with the frames."""
    family = family_for(geometry.family)
    timestamped = family.prompt_timestamps and any(item.kind == "video" for item in request.items)
    if timestamped:
        assert encode is not None, "a Qwen3-VL video request needs the tokenizer's encode"
        request = collapse_timestamped_videos(request, tokens, geometry, encode)
    prompt: dict[str, Any] = {"prompt_token_ids": collapse_vision_pads(request, tokens, geometry.merge_size,
                                                                       video_runs=not timestamped)}
    if request.items:
        media: dict[str, list[Any]] = {}
        for item in request.items:
            frames: Any = item_media(item, geometry)
            if item.kind == "video" and family.prompt_timestamps:  # vLLM's Qwen3-VL reads them from the item
                frames = (frames, video_metadata(item, geometry))
            media.setdefault(item.kind, []).append(frames)
        prompt["multi_modal_data"] = media
        prompt["mm_processor_kwargs"] = processor_kwargs(request.items, geometry)
    return prompt


def sampling_kwargs(params: SamplingParams, seed: int | None) -> dict[str, Any]:
    """Keyword arguments of `vllm.SamplingParams` for one sample (seed None: the engine's stream).

    Only `params.eos_token_ids` stop a response (ignore_eos: not the tokenizer's own EOS; the trainer
    passes the tokenizer's and the generation config's, `rollout/base.stop_token_ids`); the sampled
    token's log-probability is returned with each token (of which distribution: `logprobs_mode`)."""
    kwargs: dict[str, Any] = {
        "n": 1, "seed": None if seed is None else int(seed), "max_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p, "top_k": params.top_k, "ignore_eos": True,
        "stop_token_ids": list(params.eos_token_ids), "logprobs": 0, "skip_special_tokens": False,
        "detokenize": False,
    }
    if params.suppressed_token_ids:
        kwargs["logit_bias"] = {int(token): LOGIT_BIAS_FLOOR for token in params.suppressed_token_ids}
    return kwargs


def logprobs_mode(logprob_temperature: float) -> str:
    """vLLM's `logprobs_mode` for log-probs taken at `logprob_temperature` (the run's sampling
    temperature): at 1 its raw log-probs (the logits' log_softmax, before logit_bias, temperature and
    filtering; what the trainer computes at temperature 1, for any request); otherwise its processed
    ones, after temperature, which equal the trainer's when top-k and top-p are off and no token is
    suppressed (with them on, vLLM renormalises over the tokens left)."""
    if not logprob_temperature > 0:
        raise ValueError(f"logprob_temperature: must be > 0, got {logprob_temperature}")
    return "raw_logprobs" if logprob_temperature == 1 else "processed_logprobs"


def check_request_temperature(params: SamplingParams, logprob_temperature: float) -> None:
    """An engine whose log-probs are processed ones (`logprobs_mode`) reports them at the temperature
    its requests sample with: a request at another one would get log-probs of neither distribution."""
    if logprob_temperature != 1 and params.temperature != logprob_temperature:
        raise ValueError(f"vLLM engine: built for log-probs at temperature {logprob_temperature} "
                         f"(logprob_temperature), asked to sample at {params.temperature}")


def to_result(sample_key: str, token_ids: Sequence[int], logprobs: Sequence[Any] | None,
              params: SamplingParams) -> RolloutResult:
    """A vLLM completion (token ids and per-token {token: Logprob} dicts) as a RolloutResult.

    The response is cut after its first EOS; finish_reason follows from the tokens, not vLLM's text."""
    tokens = [int(t) for t in token_ids]
    if logprobs is None or len(logprobs) != len(tokens):
        raise ValueError(f"sample {sample_key!r}: vLLM returned {0 if logprobs is None else len(logprobs)} "
                         f"log-probs for {len(tokens)} tokens (were logprobs requested?)")
    values = []
    for token, entry in zip(tokens, logprobs):
        chosen = entry.get(token) if isinstance(entry, dict) else None
        if chosen is None:
            raise ValueError(f"sample {sample_key!r}: no log-prob for sampled token {token}")
        values.append(float(getattr(chosen, "logprob", chosen)))
    eos = set(params.eos_token_ids)
    stop = next((index for index, token in enumerate(tokens) if token in eos), None)
    if stop is not None:
        return RolloutResult(sample_key, tokens[:stop + 1], values[:stop + 1], "stop")
    return RolloutResult(sample_key, tokens, values, "length")


def check_expanded_prompt(request: RolloutRequest, vllm_prompt_ids: Sequence[int]) -> None:
    """vLLM's prompt after its own vision expansion must be the trainer's `prompt_ids` exactly: the same
    number of vision tokens per item (token ids only: not the grids' shapes nor the video timing)."""
    ours, theirs = list(request.prompt_ids), [int(t) for t in vllm_prompt_ids]
    if ours == theirs:
        return
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    raise ValueError(f"rollout request {request.sample_key!r}: vLLM expanded the prompt to {len(theirs)} tokens, "
                     f"the ShadowLoader's grids give {len(ours)} (first difference at position {first}): vLLM "
                     f"would see other vision grids than the trainer")


VLLM_WEIGHT_PREFIXES = dict(QWEN2_5_VL.vllm_weight_prefixes)
"""Qwen2.5-VL parameter prefixes -> vLLM's module prefixes, as vLLM's Qwen2_5_VLForConditionalGeneration
maps them when loading (first match wins): the in-memory names of transformers >= 4.52, which a sync
sends, and the original checkpoint names, which `save_pretrained` still writes."""


def vllm_weight_name(hf_name: str, family: str = "qwen2_5_vl") -> str:
    """Where vLLM's model of the family puts an HF parameter (a ValueError for names it would not
    load); Qwen3-VL's (dense and MoE) use Qwen2.5-VL's prefixes (`ModelFamily.vllm_weight_prefixes`)."""
    for prefix, target in dict(family_for(family).vllm_weight_prefixes).items():
        if hf_name.startswith(prefix):
            return target + hf_name[len(prefix):]
    raise ValueError(f"weight {hf_name!r}: no vLLM Qwen2.5-VL module takes it (prefixes "
                     f"{', '.join(VLLM_WEIGHT_PREFIXES)})")
