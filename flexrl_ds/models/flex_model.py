"""An HF causal LM (Qwen2.5-VL or Qwen2) running one FlexUlysses step on one rank.

`build_step_batch` turns the step's encoded samples, the plan and this rank's place into a `StepBatch`:
local token ids, local position ids (computed per whole sequence, then sliced), next-token targets,
the response mask and, for a VLM, the vision route (which units this rank encodes and where their
embeddings go). It reads only metadata every rank has, so all ranks agree without communicating.

`FlexUlyssesLM` is a plain `nn.Module` around the HF model (so DeepSpeed can wrap it): its forward
embeds the local tokens, encodes this rank's vision units and routes their embeddings into place,
runs the HF model on `inputs_embeds` with FlexUlysses attention (the layout travels as the
`flexrl_step` forward keyword, see flexrl_ds/models/hf_adapter.py) and returns per-token log-probs of
the targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from flexrl_ds.models import hf_adapter
from flexrl_ds.sp.layout import RankLayout, build_rank_layout
from flexrl_ds.models.positions import local_position_ids, sequence_positions
from flexrl_ds.models.vision_balance import VisionRoute, assign_units, build_route, representatives, vision_units

IGNORE = -100


@dataclass
class StepBatch:
    """One rank's inputs for one FlexUlysses step."""

    layout: RankLayout
    """This rank's packs (HSF order) and local token order."""
    input_ids: torch.Tensor
    """(local,) token ids."""
    position_ids: torch.Tensor
    """(3, 1, local) mRoPE positions for a VLM, (1, local) for a text model."""
    targets: torch.Tensor
    """(local,) id of the NEXT token of each local token's sequence; IGNORE at a sequence's end."""
    response_mask: torch.Tensor
    """(local,) True where the target is a response token (what log-probs and losses cover)."""
    route: VisionRoute | None = None
    """Vision units this rank encodes and the embedding exchange (VLM only)."""
    items: Mapping[str, Any] | None = None
    """seq id -> its VisionItems (pixel rows); needed for the units in `route.my_units`."""


def _targets_and_mask(sample) -> tuple[torch.Tensor, torch.Tensor]:
    ids = sample.input_ids
    targets = torch.full_like(ids, IGNORE)
    targets[:-1] = ids[1:]
    mask = torch.zeros(ids.shape[0], dtype=torch.bool)
    mask[sample.response_start - 1:ids.shape[0] - 1] = True
    return targets, mask


def build_step_batch(model, plan, samples: Mapping[str, Any], rank: int, group_tree=None,
                     positions: Mapping[str, torch.Tensor] | None = None) -> StepBatch:
    """This rank's `StepBatch` for `plan` over `samples` (EncodedSample by id; all ranks pass the same).

    `model`: the HF model (for its config and rope-index logic). `positions`: precomputed
    whole-sequence positions by id (else computed here).
    """
    config = hf_adapter.text_config(model)
    lengths = {seq_id: sample.length for seq_id, sample in samples.items()}
    layouts = [build_rank_layout(plan, lengths, r, group_tree if r == rank else None,
                                 num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads)
               for r in range(plan.world_size)]
    layout = layouts[rank]
    if positions is None:
        positions = {s: sequence_positions(model, samples[s].input_ids, samples[s].items) for s in samples}
    targets, masks = zip(*(_targets_and_mask(samples[s]) for s in samples))
    by_id = dict(zip(samples, zip(targets, masks)))
    batch = StepBatch(
        layout=layout,
        input_ids=layout.slice_tokens({s: x.input_ids for s, x in samples.items()}),
        position_ids=local_position_ids(layout, positions),
        targets=layout.slice_tokens({s: t for s, (t, _) in by_id.items()}),
        response_mask=layout.slice_tokens({s: m for s, (_, m) in by_id.items()}),
    )
    if hf_adapter.is_vision_language(model):
        batch.route = vision_route(model, plan, samples, layouts, rank)
        batch.items = {s: x.items for s, x in samples.items()}
    return batch


def vision_route(model, plan, samples: Mapping[str, Any], layouts, rank: int) -> VisionRoute:
    """Balanced vision work of the step (units spread by patches over the domain; units sharing a
    `share_key` encoded once) for `rank`."""
    config = model.config
    seq_order = [seq_id for pack in plan.packs for seq_id in pack.sequences]
    units = vision_units(seq_order, {s: samples[s].input_ids for s in seq_order},
                         {s: samples[s].items for s in seq_order},
                         (config.image_token_id, config.video_token_id), config.vision_config.spatial_merge_size)
    rep = representatives(units)
    encoded = [i for i in range(len(units)) if rep[i] == i]
    unit_rank = [0] * len(units)
    for index, owner in zip(encoded, assign_units([units[i].num_patches for i in encoded], plan.world_size)):
        unit_rank[index] = owner
    return build_route(units, [unit_rank[rep[i]] for i in range(len(units))], layouts, rank)


class FlexUlyssesLM(torch.nn.Module):
    """HF causal LM + FlexUlysses: `forward(batch) -> (token log-probs (local,), zero term)`."""

    def __init__(self, hf_model, attention=None, vision_group=None, logits_chunk: int = 4096):
        """attention: a FlexUlyssesAttention (default one with overlap). vision_group: the SP domain's
        process group for the vision embedding exchange (None: the default group). logits_chunk:
        tokens per lm_head chunk in no-grad passes (bounds the (tokens, vocab) logits memory)."""
        super().__init__()
        self.logits_chunk = logits_chunk
        from flexrl_ds.sp.attention import FlexUlyssesAttention

        self.hf_model = hf_adapter.use_flex_ulysses(hf_model)
        self.attention = attention if attention is not None else FlexUlyssesAttention()
        self.vision_group = vision_group

    def embed(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Local input embeddings with routed vision embeddings in place; and the zero term."""
        from flexrl_ds.models.vision_balance import encode_and_route

        embed_tokens = self.hf_model.get_input_embeddings()
        device = embed_tokens.weight.device
        ids = batch.input_ids
        if ids.numel() == 0:  # idle rank: one placeholder token keeps the embedding in the graph
            ids = torch.zeros(1, dtype=torch.long)
        embeds = embed_tokens(ids.to(device))
        zero = embeds.new_zeros(())
        if batch.route is None:
            return embeds, zero
        visual = self.hf_model.model.visual
        merge = self.hf_model.config.vision_config.spatial_merge_size
        rows, zero = encode_and_route(visual, batch.route, batch.items, self.vision_group, merge)
        index = batch.route.recv_local_index.to(device)
        embeds = embeds.index_copy(0, index, rows.to(embeds.dtype))
        return embeds, zero

    def forward(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, zero = self.embed(batch)
        if batch.layout.num_local_tokens == 0:
            return self._idle_forward(batch, embeds, zero)
        step = hf_adapter.FlexStep(batch.layout, self.attention)
        kwargs = dict(inputs_embeds=embeds.unsqueeze(0), position_ids=batch.position_ids.to(embeds.device),
                      use_cache=False, **{hf_adapter.STEP_KWARG: step})
        targets = batch.targets.to(embeds.device)
        if torch.is_grad_enabled():
            return _target_logprobs(self.hf_model(**kwargs).logits[0], targets), zero
        # No gradient (reference / old-policy pass): never hold (tokens, vocab) fp32 logits at once.
        hidden = self.hf_model.model(**kwargs).last_hidden_state[0]
        size = self.logits_chunk
        chunks = [_target_logprobs(self.hf_model.lm_head(hidden[i:i + size]), targets[i:i + size])
                  for i in range(0, hidden.shape[0], size)]
        return (torch.cat(chunks) if chunks else hidden.new_zeros(0)), zero

    def _idle_forward(self, batch: StepBatch, embeds, zero) -> tuple[torch.Tensor, torch.Tensor]:
        """A rank without tokens: one placeholder token through every module (ZeRO-3 gathers are
        collective), local attention only (it is in no pack), output folded into the zero term."""
        placeholder = embeds.unsqueeze(0)  # (1, 1, hidden): the embedded placeholder token
        positions = torch.zeros((batch.position_ids.shape[0], 1, 1) if batch.position_ids.dim() == 3 else (1, 1),
                                dtype=torch.long, device=embeds.device)
        step = hf_adapter.FlexStep(batch.layout, self.attention, idle=True)
        logits = self.hf_model(inputs_embeds=placeholder, position_ids=positions, use_cache=False,
                               **{hf_adapter.STEP_KWARG: step}).logits
        return logits.new_zeros(0, dtype=torch.float32), zero + logits.float().sum() * 0.0


def _target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per row, in fp32 (targets < 0 give an arbitrary value the caller masks)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)


def reference_logprobs(model, sample) -> torch.Tensor:
    """Plain single-process HF log-probs of a sample's response tokens (model.forward, HF positions)."""
    kwargs = reference_inputs(model, sample)
    logits = model(**kwargs).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, sample.input_ids[1:].unsqueeze(1)).squeeze(1)
    return logprobs[sample.response_start - 1:]


def reference_inputs(model, sample) -> dict:
    """What the HF processor would hand the model for one sample (batch of 1)."""
    from flexrl_ds.models.positions import mm_token_type_ids

    kwargs: dict[str, Any] = {"input_ids": sample.input_ids.unsqueeze(0)}
    if not hf_adapter.is_vision_language(model):
        return kwargs
    dtype = next(model.parameters()).dtype
    images = [i for i in sample.items if i.kind == "image"]
    videos = [i for i in sample.items if i.kind == "video"]
    if images:
        kwargs["pixel_values"] = torch.cat([i.pixel_values for i in images]).to(dtype)
        kwargs["image_grid_thw"] = torch.tensor([list(i.grid_thw) for i in images])
    if videos:
        kwargs["pixel_values_videos"] = torch.cat([i.pixel_values for i in videos]).to(dtype)
        kwargs["video_grid_thw"] = torch.tensor([list(i.grid_thw) for i in videos])
        kwargs["second_per_grid_ts"] = torch.tensor([i.second_per_grid_t for i in videos])
    kwargs["mm_token_type_ids"] = mm_token_type_ids(kwargs["input_ids"], model.config.image_token_id,
                                                    model.config.video_token_id)
    return kwargs
