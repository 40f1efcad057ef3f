"""`ModelFamily`: the interface every model family implements, and the text-only family.

Methods take plain values and duck-typed objects (a `MediaConfig`, `VisionItem`s, an HF model), so this
package imports nothing of flexrl_ds but `common`. torch and transformers are imported inside methods.

A vision item here is anything with `kind` ("image" | "video"), `grid_thw`, `num_tokens(merge)`, and for
videos `second_per_grid_t`, `frame_indices` and `source_fps` (models/processing.py `VisionItem`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True)
class DecoderExtras:
    """Per-token decoder inputs beyond the embeddings that a family's tower produces (DeepStack)."""

    vision_mask: Any
    """(1, local) bool: the local tokens that are vision tokens, in local order."""
    features: list
    """Per decoder layer k: (vision tokens of `vision_mask`, hidden) rows added after layer k."""


class ModelFamily:
    """Everything that differs between model families (one subclass per family module)."""

    model_type: str = ""
    """HF `config.model_type`."""
    display_name: str = ""
    """Named in messages, e.g. "Qwen2.5-VL"."""
    hf_class: str = ""
    """transformers class of the whole model (`flexrl make-tiny-model`, saved configs)."""
    has_vision: bool = True

    # ---- media: processor files and geometry (media/processor_files.py, media/vision_geometry.py) ----------
    processor_classes: tuple[str, ...] = ()
    """`processor_class` values of a saved processor of this family (a folder without config.json)."""
    image_processor_types: tuple[str, ...] = ()
    """`image_processor_type` values whose rules this family reproduces."""
    video_processor_types: tuple[str, ...] = ()
    """`video_processor_type` values whose rules this family reproduces."""
    processor_defaults: dict[str, Any] = {}
    """The image processor class's attributes used where a saved file leaves a key out."""
    video_processor_defaults: dict[str, Any] | None = None
    """The video processor class's (None: those of the image processor)."""
    image_size_default: dict[str, int] = {}
    video_size_default: dict[str, int] = {}

    prompt_timestamps: bool = False
    """Each video's temporal groups come with their timestamps as text (Qwen3-VL)."""
    video_budget_over_frames: bool = False
    """The video processor's size bounds cover all of a video's frames (Qwen3-VL), not one frame."""

    def video_frame_positions(self, num_frames: int, video_fps: float, target_fps: float, min_frames: int,
                              max_frames: int, temporal_patch_size: int) -> list[int]:
        """Sampled positions (0-based, within the `num_frames` in range) of a video."""
        raise NotImplementedError

    def video_frame_size(self, height: int, width: int, num_sampled: int, config: Any,
                         max_pixels: int) -> tuple[int, int]:
        """(height, width) every sampled frame is resized to. `config`: a `MediaConfig`."""
        raise NotImplementedError

    def group_timestamps(self, item: Any, temporal_patch_size: int) -> list[float] | None:
        """Seconds shown in the prompt before each temporal group of a video; None: no timestamps."""
        return None

    # ---- prompts and positions --------------------------------------------------------------------------
    def expand_pads(self, record_id: str, text: str, items: Sequence[Any], merge_size: int,
                    temporal_patch_size: int = 2) -> str:
        """The chat-rendered prompt with each item's placeholder expanded as the HF processor does."""
        if items:
            raise ValueError(f"record {record_id!r}: media items but a text-only model")
        return text

    def sequence_positions(self, config: Any, input_ids_L: Any, items: Sequence[Any]) -> Any:
        """Whole-sequence position ids: (3, L) for mRoPE models, (1, L) for text models."""
        import torch

        if items:
            raise ValueError("sequence has vision items but the model is text-only")
        length = int(input_ids_L.shape[0])
        return torch.arange(length, dtype=torch.long).view(1, length)

    # ---- model calls ------------------------------------------------------------------------------------
    def vision_tower(self, hf_model: Any) -> Any:
        """The vision tower module (None for a text model)."""
        return None

    def encode_vision(self, visual: Any, pixels: Any, grids: Any, inputs: dict | None = None) -> tuple[Any, Any]:
        """(merged rows (tokens, hidden), extra rows (tokens, k*hidden) or None) of one tower call.
        inputs: `vision_call_inputs`' keywords, on the tower's device (None: the tower computes them)."""
        raise NotImplementedError

    def vision_call_inputs(self, visual: Any, grids: Any) -> dict[str, Any]:
        """The tower call's grid-derived inputs (rotary position ids, window order, sequence bounds and
        their maxima), computed on the host from `grids` (a CPU tensor) by transformers' own
        `vision_utils` functions, to pass as the call's keywords: the tower then neither reads its
        device grids back nor builds these tensors item by item on the device. {}: none."""
        return {}

    def num_extra_features(self, config: Any) -> int:
        """Extra hidden-sized rows per vision token the tower returns (DeepStack levels); 0: none."""
        return 0

    def run_decoder(self, hf_model: Any, embeds_1LH: Any, position_ids: Any, extras: DecoderExtras | None,
                    **kwargs) -> Any:
        """The decoder over `inputs_embeds`; returns its output (`last_hidden_state` (1, L, hidden))."""
        return hf_model.model(inputs_embeds=embeds_1LH, position_ids=position_ids, use_cache=False, **kwargs)

    def router_logits(self, output: Any) -> list | None:
        """A sparse decoder's router logits of `run_decoder`'s output, one (tokens, experts) tensor per
        sparse layer; None for a dense model."""
        return None

    def router_top_k(self, config: Any) -> int:
        """Experts per token of a sparse decoder."""
        raise NotImplementedError

    def reference_inputs(self, model: Any, sample: Any) -> dict:
        """What the HF processor would hand the model for one sample (batch of 1)."""
        return {"input_ids": sample.input_ids.unsqueeze(0)}

    def zero3_leaf_modules(self, hf_model: Any) -> list:
        """Module classes ZeRO-3 must gather as a whole (a sparse MoE block); [] for dense models."""
        return []

    # ---- cost ---------------------------------------------------------------------------------------------
    def vision_shape_fields(self, vision_config: Any) -> dict:
        """`models.flops.VisionShape` fields of the tower."""
        raise NotImplementedError

    # ---- vLLM ---------------------------------------------------------------------------------------------
    vllm_weight_prefixes: tuple[tuple[str, str], ...] = (("model.", "model."), ("lm_head.", "lm_head."))
    """HF parameter prefix -> vLLM module prefix, first match wins."""

    def vllm_video_metadata(self, item: Any, geometry: Any) -> dict:
        """The `video_metadata` vLLM needs to rebuild the trainer's prompt for one video."""
        raise NotImplementedError


class TextFamily(ModelFamily):
    """Every text-only causal LM (Qwen2, ...): 1D positions, no vision."""

    model_type = "text"
    display_name = "a text-only model"
    has_vision = False


TEXT = TextFamily()
