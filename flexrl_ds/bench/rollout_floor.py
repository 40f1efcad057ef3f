"""The least time any engine can take for a rollout batch on one GPU: a roofline floor. Pure.

A batch of `prompts` text prompts of `prompt_len` tokens, each generating `new_tokens` tokens, on a
decoder of a given shape in a 2-byte dtype. The floor counts only what no engine can avoid:
- prefill: every prompt token through every matmul weight (2 FLOPs per weight), causal attention
  (query i attends i + 1 keys: 4 · query heads · head_dim FLOPs per key per layer), the LM head for
  the last position only; at least one read of the weights; time = max(FLOPs ÷ peak FLOP/s,
  bytes ÷ peak bytes/s);
- each of the `new_tokens - 1` decode steps (the prefill gives the first token): one read of every
  matmul weight and of every prompt's KV cache so far, and the step's FLOPs; time = max of the two.
Nothing else is charged: no sampling, no scheduling, no kernel launch, no vision tower (the bench's
prompts are text). So a measured engine is slower than the floor, and no engine can be more than
(a baseline's time ÷ the floor) times faster than that baseline on the same batch and GPU.

`flexrl bench rollout` measures the two peaks on its GPU (a bf16 GEMM and a device copy) and reports
every engine's share of the floor (bench/rollout_bench.py). Tested against torch's FLOP counter and
a real KV cache of a tiny Qwen2.5-VL (tests/unit/bench/test_rollout_floor.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from flexrl_ds.models.flops import DecoderShape, decode_step_flops, prefill_flops

__all__ = ["DecoderShape", "Peaks", "RolloutFloor", "decode_step_flops", "prefill_flops", "rollout_floor"]


@dataclass(frozen=True)
class Peaks:
    """What the GPU reaches (measured by the bench: a bf16 GEMM, a device-to-device copy)."""

    flops_per_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if self.flops_per_s <= 0 or self.bytes_per_s <= 0:
            raise ValueError(f"peaks must be positive, got {self.flops_per_s} FLOP/s and {self.bytes_per_s} B/s")


@dataclass(frozen=True)
class RolloutFloor:
    """The floor of one batch (module docstring)."""

    prefill_s: float
    decode_s: float
    tokens: int
    """Tokens the batch generates."""

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def rollout_floor(shape: DecoderShape, prompts: int, prompt_len: int, new_tokens: int, peaks: Peaks,
                  dtype_bytes: int = 2) -> RolloutFloor:
    """The floor of `prompts` prompts of `prompt_len` tokens generating `new_tokens` each (module docstring)."""
    if min(prompts, prompt_len, new_tokens) < 1:
        raise ValueError(f"prompts, prompt_len and new_tokens must be at least 1, got {prompts}, {prompt_len}, "
                         f"{new_tokens}")
    weight_bytes = float(shape.matmul_params() * dtype_bytes)
    kv_token = shape.kv_bytes_per_token(dtype_bytes)
    prefill_bytes = weight_bytes + prompts * prompt_len * kv_token
    prefill_s = max(prompts * prefill_flops(shape, prompt_len) / peaks.flops_per_s,
                    prefill_bytes / peaks.bytes_per_s)
    decode_s = 0.0
    for position in range(prompt_len, prompt_len + new_tokens - 1):
        step_bytes = weight_bytes + prompts * (position + 1) * kv_token
        decode_s += max(prompts * decode_step_flops(shape, position) / peaks.flops_per_s,
                        step_bytes / peaks.bytes_per_s)
    return RolloutFloor(prefill_s, decode_s, prompts * new_tokens)
