"""FLOPs of a decoder's passes, and the GPUs' peaks they are measured against. Pure.

Counted as PaLM and Megatron count model FLOPs: 2 FLOPs per matmul weight per token (every layer's
q, k, v, o and gated MLP; the LM head where logits are taken), causal attention 4 · query heads ·
head_dim FLOPs per (query, key) pair per layer, query i attending i + 1 keys; a backward pass twice
its forward. Not counted: norms, rotary, softmax, and layers recomputed under activation
checkpointing (MFU, not HFU).

- `DecoderShape`: the sizes these need, from a HF text config.
- `prefill_flops` / `decode_step_flops`: a rollout's (bench/rollout_floor.py).
- `training_forward_flops`: one sequence's forward with logits at every position (the trainer's
  log-prob passes; ×3 for forward and backward).
- `VisionShape` / `vision_unit_flops`: a Qwen2.5-VL vision tower's forward over one image or one
  temporal patch group of a video (the patch embedding, every block's matmuls, attention within
  the windows or, in the full-attention blocks, over the whole unit, and the patch merger);
  `encoded_grids` / `vision_flops`: over the items a pass encodes (shared media once).
- `peak_bf16_flops`: the datasheet bf16 dense peak of a GPU by name (None where unknown), what MFU
  divides by (trainer/driver.py `mfu`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from flexrl_ds.families.qwen2_5_vl import QWEN2_5_VL
from flexrl_ds.planning.cost_model import LayerShapes, active_intermediate_size


@dataclass(frozen=True)
class DecoderShape:
    """The decoder sizes the floor needs (a HF text config's fields)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    intermediate_size: int
    vocab_size: int
    head_dim: int

    @classmethod
    def from_config(cls, text_config: Any) -> "DecoderShape":
        """From a HF text config (Qwen2 / Qwen2.5-VL's `get_text_config()`); a MoE's MLP width is
        its active experts' (`cost_model.active_intermediate_size`)."""
        heads = int(text_config.num_attention_heads)
        head_dim = getattr(text_config, "head_dim", None) or int(text_config.hidden_size) // heads
        return cls(int(text_config.hidden_size), heads, int(text_config.num_key_value_heads),
                   int(text_config.num_hidden_layers), active_intermediate_size(vars(text_config)),
                   int(text_config.vocab_size), int(head_dim))

    def layer_shapes(self) -> LayerShapes:
        """The planner's view of one decoder layer (planning/cost_model.py)."""
        return LayerShapes(self.hidden_size, self.intermediate_size, self.num_attention_heads,
                           self.num_key_value_heads, self.head_dim, self.num_hidden_layers)

    def layer_matmul_params(self) -> int:
        """Weights of one decoder layer's matmuls: q, k, v, o and the gated MLP (biases and norms left
        out), as the planner's cost model counts them."""
        return self.layer_shapes().params_per_layer()

    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def matmul_params(self) -> int:
        """Every weight a decode step multiplies by: all layers and the LM head."""
        return self.num_hidden_layers * self.layer_matmul_params() + self.lm_head_params()

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV cache of one token over all layers."""
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * dtype_bytes

    def attention_flops_per_key(self) -> int:
        """QKᵀ and PV for one query and one key, all layers: 2 matmuls × 2 FLOPs × query heads × head_dim."""
        return self.num_hidden_layers * 4 * self.num_attention_heads * self.head_dim


def prefill_flops(shape: DecoderShape, prompt_len: int) -> float:
    """One prompt's prefill: every token through every layer, causal attention, the LM head once."""
    layers = 2.0 * shape.num_hidden_layers * shape.layer_matmul_params() * prompt_len
    attention = shape.attention_flops_per_key() * prompt_len * (prompt_len + 1) / 2
    return layers + attention + 2.0 * shape.lm_head_params()


def decode_step_flops(shape: DecoderShape, position: int) -> float:
    """One prompt's decode step for the token at `position` (0-based): it attends position + 1 keys."""
    return 2.0 * shape.matmul_params() + shape.attention_flops_per_key() * (position + 1)


def training_forward_flops(shape: DecoderShape, length: int) -> float:
    """One sequence of `length` tokens through the decoder, logits at every position."""
    layers = 2.0 * shape.num_hidden_layers * shape.layer_matmul_params() * length
    attention = shape.attention_flops_per_key() * length * (length + 1) / 2
    return layers + attention + 2.0 * shape.lm_head_params() * length


@dataclass(frozen=True)
class VisionShape:
    """The vision tower sizes `vision_unit_flops` needs (a Qwen2.5-VL vision config's fields)."""

    hidden_size: int
    intermediate_size: int
    depth: int
    full_attention_blocks: int
    patch_dim: int
    """in_channels × temporal_patch_size × patch_size²: one patch's pixel values."""
    merge_size: int
    window_merged: int
    """Merged tokens along one side of a window (window_size // patch_size // merge_size)."""
    out_hidden_size: int
    num_mergers: int = 1
    """Patch mergers run over every unit (Qwen3-VL: 1 + its DeepStack mergers)."""

    @classmethod
    def from_config(cls, vision_config: Any, family: Any = None) -> "VisionShape":
        """From a vision config, by its family's fields (`ModelFamily.vision_shape_fields`; None:
        Qwen2.5-VL's, windows and full-attention blocks)."""
        return cls(**(family or QWEN2_5_VL).vision_shape_fields(vision_config))


def _window_sides(merged: int, window: int) -> list[int]:
    return [min(window, merged - start) for start in range(0, merged, window)]


def vision_unit_flops(shape: VisionShape, grid_h: int, grid_w: int) -> float:
    """Forward FLOPs of one unit of grid_h × grid_w patches (module docstring)."""
    patches = grid_h * grid_w
    d, merge = shape.hidden_size, shape.merge_size
    block_matmuls = 2.0 * patches * (4 * d * d + 3 * d * shape.intermediate_size)
    window_keys = sum((rows * cols * merge * merge) ** 2
                      for rows in _window_sides(grid_h // merge, shape.window_merged)
                      for cols in _window_sides(grid_w // merge, shape.window_merged))
    windowed = shape.depth - shape.full_attention_blocks
    attention = 4.0 * d * (windowed * window_keys + shape.full_attention_blocks * patches * patches)
    merged = patches // (merge * merge)
    merger = 2.0 * merged * (merge ** 4 * d * d + merge * merge * d * shape.out_hidden_size) * shape.num_mergers
    return 2.0 * patches * shape.patch_dim * d + shape.depth * block_matmuls + attention + merger


def encoded_grids(samples: Iterable[tuple[str, Any]], shared: bool = True) -> list[tuple[int, int, int]]:
    """grid_thw of each vision item that `(name, sample)` pairs make a pass encode: items with the same
    `share_key` once when `shared` (models/vision_balance.py), else every sample's own."""
    grids = {}
    for name, sample in samples:
        for index, item in enumerate(sample.items):
            grids[(item.share_key if shared and item.share_key else (name, index))] = tuple(item.grid_thw)
    return list(grids.values())


def vision_flops(shape: VisionShape, grids: Iterable[tuple[int, int, int]]) -> float:
    """Forward FLOPs of encoding items of these grid_thw (a video once per temporal group)."""
    return sum(t * vision_unit_flops(shape, h, w) for t, h, w in grids)


PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H200 NVL", 835e12), ("GH200", 989.4e12),
                   ("H100", 989.4e12), ("H200", 989.4e12),
                   ("H800", 989.4e12), ("H20", 148e12), ("B200", 2.25e15), ("B100", 1.75e15),
                   ("A100", 312e12), ("A800", 312e12), ("L40S", 362.05e12), ("L40", 181.05e12))
"""Datasheet bf16 dense (no sparsity) FLOP/s by a name fragment, more specific names first."""


def peak_bf16_flops(device_name: str | None) -> float | None:
    """The bf16 dense peak of the GPU named `device_name` (e.g. "NVIDIA H200"); None where unknown."""
    if not device_name:
        return None
    for fragment, flops in PEAK_BF16_FLOPS:
        if fragment in device_name:
            return flops
    return None
