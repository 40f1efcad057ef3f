"""The least time a GRPO step can take on its GPUs, per phase: a roofline floor from the model's
FLOPs and bytes. Pure (no torch).

Inputs: the step's token counts (per prompt, its prompt tokens, each sample's response tokens and the
forward FLOPs of its media through the vision tower), the model's shape (models/flops.py
`DecoderShape`, the vision tower's parameter count) and the GPUs' peaks (`DevicePeaks`: datasheet bf16
dense FLOP/s and memory bytes/s). Every phase is charged only what no implementation can avoid, with
its work spread perfectly over the `num_gpus` GPUs; each term is max(FLOPs ÷ (GPUs × peak FLOP/s),
bytes ÷ (GPUs × peak bytes/s)). FLOPs are counted as in models/flops.py (2 per matmul weight per
token, causal attention 4 · query heads · head_dim per (query, key) pair per layer, a backward
twice its forward); 2-byte weights and KV cache.

- rollout: one prefill per prompt (its samples share it: the prompt's tokens through every layer,
  causal attention, the LM head at the last position, the media through the vision tower; one read
  of the weights and a write of the prompt's KV cache), then one decode step per generated token
  after the first (the prefill gives it) while any sample is still generating: every active sample's
  token through every weight and the LM head, attending all keys so far; one read of the weights and
  of the KV cache (a prompt's KV once for its samples, each sample's own response KV). As
  bench/rollout_floor.py for a batch of equal prompts, one sample each.
- inference: per log-prob pass (old policy, reference: as many as ran), every sample through the
  decoder (all its tokens) with the LM head at its response positions only (the loss needs no
  other logits), each prompt's media once; one read of the weights.
- update: three times that forward (forward and backward); two reads of the weights (forward,
  backward); then AdamW over every parameter: the fp32 gradient read, fp32 master weight and both
  moments read and written, the bf16 weight written (`OPTIMIZER_BYTES_PER_PARAM`).
- sync: every weight read once and written once (into the rollout engines).
Not charged: data loading, rewards, norms, softmax, sampling, recomputation under activation
checkpointing, communication, kernel launches. So a measured phase is slower than its floor; the
ratio measured ÷ floor says how far from the hardware's limit it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from flexrl_ds.models.flops import DecoderShape, VisionShape, decode_step_flops, prefill_flops

WEIGHT_BYTES = 2
"""Bytes of one weight or KV-cache element (bf16)."""
OPTIMIZER_BYTES_PER_PARAM = 4 + 2 * 3 * 4 + 2
"""AdamW, one parameter: its fp32 gradient read, its fp32 master weight and two moments read and
written, its bf16 weight written."""
PHASES = ("rollout", "inference", "update", "sync")
"""The phases with a floor (data and reward have none)."""

PEAK_HBM_BYTES = (("H100 PCIe", 2.0e12), ("H100 NVL", 3.9e12), ("H200 NVL", 4.8e12), ("GH200", 4.0e12),
                  ("H100", 3.35e12), ("H200", 4.8e12), ("H800", 3.35e12), ("H20", 4.0e12), ("B200", 8.0e12),
                  ("B100", 8.0e12), ("A100-SXM4-40GB", 1.555e12), ("A100-PCIE-40GB", 1.555e12), ("A100", 2.039e12),
                  ("A800", 2.039e12), ("L40S", 864e9), ("L40", 864e9))
"""Datasheet memory bandwidth (bytes/s) by a name fragment, more specific names first (as
models/flops.py `PEAK_BF16_FLOPS`)."""


def peak_hbm_bytes(device_name: str | None) -> float | None:
    """The memory bandwidth of the GPU named `device_name`; None where unknown."""
    if not device_name:
        return None
    for fragment, bandwidth in PEAK_HBM_BYTES:
        if fragment in device_name:
            return bandwidth
    return None


@dataclass(frozen=True)
class DevicePeaks:
    """What one GPU reaches at best."""

    flops_per_s: float
    """bf16 dense FLOP/s."""
    bytes_per_s: float
    """Memory bytes/s."""

    def __post_init__(self) -> None:
        if not (self.flops_per_s > 0 and self.bytes_per_s > 0):
            raise ValueError(f"peaks must be positive, got {self.flops_per_s} FLOP/s and {self.bytes_per_s} B/s")


@dataclass(frozen=True)
class PromptTokens:
    """What the floor needs of one prompt of the step."""

    prompt_tokens: int
    """Tokens of the prompt (vision placeholders included): what its samples share."""
    response_tokens: tuple[int, ...]
    """Generated tokens of each of its samples."""
    vision_forward_flops: float = 0.0
    """Forward FLOPs of its media through the vision tower (models/flops.py `vision_flops`), once."""


@dataclass(frozen=True)
class StepFloor:
    """Seconds of each phase's floor (module docstring)."""

    prefill_s: float
    decode_s: float
    inference_s: float
    update_s: float
    sync_s: float

    @property
    def rollout_s(self) -> float:
        return self.prefill_s + self.decode_s

    def phases(self) -> dict[str, float]:
        """Phase -> floor seconds, and `step`: their sum."""
        seconds = {"rollout": self.rollout_s, "inference": self.inference_s, "update": self.update_s,
                   "sync": self.sync_s}
        return {**seconds, "step": sum(seconds.values())}


def vision_params(shape: VisionShape) -> int:
    """Matmul weights of a Qwen2.5-VL vision tower (what `vision_unit_flops` multiplies by): the patch
    embedding, every block's attention and gated MLP, the merger's two layers."""
    d, merge = shape.hidden_size, shape.merge_size
    blocks = shape.depth * (4 * d * d + 3 * d * shape.intermediate_size)
    merger = merge ** 4 * d * d + merge * merge * d * shape.out_hidden_size
    return shape.patch_dim * d + blocks + merger


def forward_flops(shape: DecoderShape, length: int, response: int) -> float:
    """One sample of `length` tokens through the decoder, the LM head at its `response` positions."""
    layers = 2.0 * shape.num_hidden_layers * shape.layer_matmul_params() * length
    attention = shape.attention_flops_per_key() * length * (length + 1) / 2
    return layers + attention + 2.0 * shape.lm_head_params() * response


def step_floor(shape: DecoderShape, prompts: Iterable[PromptTokens], peaks: DevicePeaks, num_gpus: int = 1,
               logprob_passes: int = 1, other_params: int = 0) -> StepFloor:
    """The floor of one step (module docstring). `logprob_passes`: the log-prob passes that ran (0–2);
    `other_params`: weights beside the decoder's matmuls and the LM head that are read, trained and
    synced (the vision tower's: `vision_params`)."""
    prompts = list(prompts)
    if num_gpus < 1 or logprob_passes < 0:
        raise ValueError(f"num_gpus must be >= 1 and logprob_passes >= 0, got {num_gpus}, {logprob_passes}")
    flops_per_s, bytes_per_s = num_gpus * peaks.flops_per_s, num_gpus * peaks.bytes_per_s
    params = shape.matmul_params() + other_params
    weights = float(params * WEIGHT_BYTES)
    vision = sum(p.vision_forward_flops for p in prompts)
    kv_token = shape.kv_bytes_per_token(WEIGHT_BYTES)
    prefill = max((sum(prefill_flops(shape, p.prompt_tokens) for p in prompts) + vision) / flops_per_s,
                  (weights + kv_token * sum(p.prompt_tokens for p in prompts)) / bytes_per_s)
    forward = vision + sum(forward_flops(shape, p.prompt_tokens + r, r) for p in prompts for r in p.response_tokens)
    inference = logprob_passes * max(forward / flops_per_s, weights / bytes_per_s)
    update = max(3 * forward / flops_per_s, 2 * weights / bytes_per_s)
    update += params * OPTIMIZER_BYTES_PER_PARAM / bytes_per_s
    return StepFloor(prefill, _decode_floor(shape, prompts, weights, flops_per_s, bytes_per_s), inference, update,
                     2 * weights / bytes_per_s)


def _decode_floor(shape: DecoderShape, prompts: list[PromptTokens], weights: float, flops_per_s: float,
                  bytes_per_s: float) -> float:
    """Decode steps k = 1, 2, …: the samples with more than k response tokens generate their
    (k + 1)-th, attending prompt + k keys; the step reads the weights, the prompts' KV once each and
    every active sample's k response tokens' KV."""
    kv_token = shape.kv_bytes_per_token(WEIGHT_BYTES)
    seconds, step = 0.0, 1
    active = [(p.prompt_tokens, [r for r in p.response_tokens if r > 1]) for p in prompts]
    while True:
        active = [(prompt, [r for r in responses if r > step]) for prompt, responses in active]
        active = [(prompt, responses) for prompt, responses in active if responses]
        if not active:
            return seconds
        flops = sum(len(responses) * decode_step_flops(shape, prompt + step - 1) for prompt, responses in active)
        kv_tokens = sum(prompt + len(responses) * step for prompt, responses in active)
        seconds += max(flops / flops_per_s, (weights + kv_tokens * kv_token) / bytes_per_s)
        step += 1
