"""An HF causal LM (a vision-language model of flexrl_ds/families/, or a text LM) running one FlexUlysses
step on one rank.

`place_rank` is the rank's one metadata pass over a step: from the HF config, the plan and the
step's samples it builds the rank's layout and its vision route (which units it encodes, where their
embeddings go), before any weight is loaded (the pixel fetch starts from `RankPlacement.units`).
`build_step_batch` adds the tensors: local token ids, local position ids (computed per whole sequence,
then sliced), next-token targets and the response mask. It reads only metadata every rank has, so
all ranks agree without communicating.

`FlexUlyssesLM` is a plain `nn.Module` around the HF model (so DeepSpeed can wrap it): its forward
embeds the local tokens, encodes this rank's vision units and routes their embeddings into place,
runs the HF decoder on `inputs_embeds` (the family's call, `ModelFamily.run_decoder`; with Qwen3-VL's
DeepStack rows, which travel with the merged vision rows, added after its first decoder layers at this
rank's vision tokens) with FlexUlysses attention (the layout travels as the
`flexrl_step` forward keyword, see flexrl_ds/models/hf_adapter.py) and returns per-token log-probs of
the targets at the response rows (the only rows a loss or a log-prob pass reads: the prompt's and the
vision placeholders' hidden states never go through the vocabulary-sized lm_head; 0 there)
(and their distributions' entropy when asked) under the logits divided by the sampling
temperature (the distribution the rollout drew from, before top-k / top-p), computed in chunks of as many
tokens as `logits_chunk_bytes` allows (models/logprob_chunks.py: each target's logit minus the row's
log-sum-exp, no log-softmax): full (tokens, vocab) logits never exist, with or without grad (each chunk is
checkpointed, so backward recomputes one chunk's logits at a time, and its gradient needs no saved
(tokens, vocab) block).

Collectives are the same on every rank: a rank without tokens still runs every module once (on one
placeholder token) and joins the exchanges of the packs it belongs to with zero tokens; under ZeRO-3
(`zero_group` set) the number of lm_head chunks is the maximum over the group, ranks with fewer
tokens running empty chunks, because every lm_head call gathers its partitioned weight.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from flexrl_ds.families import family_of
from flexrl_ds.families.base import DecoderExtras
from flexrl_ds.models import hf_adapter, logprob_chunks
from flexrl_ds.models.moe import RouterStats, router_stats
from flexrl_ds.models.positions import local_position_ids, sequence_positions
from flexrl_ds.models.vision_balance import (VisionRoute, assign_units, build_route, encode_and_route,
                                             representatives, vision_units)
from flexrl_ds.parallel.device import to_device
from flexrl_ds.parallel.profiling import region
from flexrl_ds.sp.attention import FlexUlyssesAttention
from flexrl_ds.sp.layout import RankLayout, build_rank_layout

IGNORE = -100

PositionsFn = Callable[[torch.Tensor, Any], torch.Tensor]
"""(whole-sequence input_ids (L,), its VisionItems) -> whole-sequence positions ((3, L) or (1, L))."""


def _is_vision_language(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank's work of a step lies, from metadata alone (no weights, no pixels)."""

    layout: RankLayout
    """This rank's packs (HSF order) and local token order."""
    route: VisionRoute | None
    """Vision units this rank encodes and the embedding exchange; None for a text model."""

    @property
    def units(self) -> tuple:
        """The vision units this rank encodes (what it fetches pixels for)."""
        return self.route.my_units if self.route is not None else ()


def place_rank(config, plan, samples: Mapping[str, Any], rank: int, group_tree=None) -> RankPlacement:
    """This rank's layout and vision route for `plan` over `samples` (EncodedSample by id, the same on
    every rank). `config`: the HF model config. `group_tree`: process groups of this rank's packs
    (None: a layout without groups, for planning and tests)."""
    text = _text_config(config)
    lengths = {seq_id: sample.length for seq_id, sample in samples.items()}
    layouts = [build_rank_layout(plan, lengths, r, group_tree if r == rank else None,
                                 num_heads=text.num_attention_heads, num_kv_heads=text.num_key_value_heads)
               for r in range(plan.world_size)]
    route = vision_route(config, plan, samples, layouts, rank) if _is_vision_language(config) else None
    return RankPlacement(layouts[rank], route)


def positions_fn(model) -> PositionsFn:
    """Whole-sequence positions of the model's kind (mRoPE for Qwen2-VL-style models: positions.py)."""
    return functools.partial(sequence_positions, model)


def _config_positions(config, input_ids_L: torch.Tensor, items) -> torch.Tensor:
    """Positions of a sequence without vision items: 0..L-1 ((3, L) for an mRoPE model)."""
    if items:
        raise ValueError("build_step_batch: a sequence with vision items needs mRoPE positions: pass "
                         "positions=positions_fn(model) or precomputed whole-sequence positions")
    length = int(input_ids_L.shape[0])
    rows = 3 if _is_vision_language(config) else 1
    return torch.arange(length, dtype=torch.long).view(1, length).expand(rows, length).contiguous()


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
    response_tokens: Mapping[str, int] | None = None
    """seq id -> response tokens of the WHOLE sequence (every sequence of the step; a sequence's
    tokens may lie on several ranks): the per-sequence denominators of `sequence_mean`."""


def _targets_and_mask(sample) -> tuple[torch.Tensor, torch.Tensor]:
    ids = sample.input_ids
    targets = torch.full_like(ids, IGNORE)
    targets[:-1] = ids[1:]
    mask = torch.zeros(ids.shape[0], dtype=torch.bool)
    mask[sample.response_start - 1:ids.shape[0] - 1] = True
    return targets, mask


def build_step_batch(config, plan, samples: Mapping[str, Any], rank: int, group_tree=None,
                     positions: Mapping[str, torch.Tensor] | PositionsFn | None = None,
                     placement: RankPlacement | None = None) -> StepBatch:
    """This rank's `StepBatch` for `plan` over `samples` (EncodedSample by id; all ranks pass the same).

    `config`: the HF model config (or the HF model itself: its config, and by default its own
    positions). `positions`: whole-sequence positions by id, or a function computing them
    (`positions_fn(model)`); None: 0..L-1, which is only right for sequences without vision items (a
    sequence with items then raises). `placement`: this rank's `place_rank` result when already
    computed (e.g. to start the pixel fetch); None: computed here.
    """
    if isinstance(config, torch.nn.Module):
        positions = positions_fn(config) if positions is None else positions
        config = config.config
    if placement is None:
        placement = place_rank(config, plan, samples, rank, group_tree)
    assert placement.layout.rank == rank, (placement.layout.rank, rank)
    layout = placement.layout
    if positions is None:
        positions = functools.partial(_config_positions, config)
    if callable(positions):
        seq_ids = [seq_id for seq_id, *_ in layout.segments()] or list(samples)[:1]  # (an idle rank: shape only)
        positions = {s: positions(samples[s].input_ids, samples[s].items) for s in seq_ids}
    ids = {s: x.input_ids for s, x in samples.items()}
    by_id = {s: _targets_and_mask(x) for s, x in samples.items()}
    if not samples:  # a plan without sequences (an idle SP domain): empty slices of the right kinds
        ids, by_id, positions = _placeholder_inputs(config)
    batch = StepBatch(
        layout=layout,
        input_ids=layout.slice_tokens(ids),
        position_ids=local_position_ids(layout, positions),
        targets=layout.slice_tokens({s: t for s, (t, _) in by_id.items()}),
        response_mask=layout.slice_tokens({s: m for s, (_, m) in by_id.items()}),
        route=placement.route,
        response_tokens={s: x.length - x.response_start for s, x in samples.items()},
    )
    if placement.route is not None:
        batch.items = {s: x.items for s, x in samples.items()}
    return batch


def _placeholder_inputs(config) -> tuple[dict, dict, dict]:
    """Token ids, (targets, mask) and positions of one placeholder token under the id "" (no real
    sequence has it): what `slice_tokens` takes its dtypes and shapes from when a rank's plan holds no sequence."""
    token = torch.zeros(1, dtype=torch.long)
    return {"": token}, {"": (token, torch.zeros(1, dtype=torch.bool))}, {"": _config_positions(config, token, ())}


def vision_route(config, plan, samples: Mapping[str, Any], layouts, rank: int) -> VisionRoute:
    """Balanced vision work of the step (units spread by patches over the domain; units sharing a
    `share_key` encoded once) for `rank`. `config`: the HF config of a vision-language model."""
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


class TokenOutputs(NamedTuple):
    """What `FlexUlyssesLM.forward` returns for one rank's local tokens."""

    logprobs: torch.Tensor
    """(local,) fp32 log p(target) at the response rows (`StepBatch.response_mask`), 0 at every other
    row (prompt and vision rows skip lm_head: mask with response_mask)."""
    entropy: torch.Tensor | None
    """(local,) fp32 entropy of each response row's next-token distribution (0 elsewhere); None unless asked for."""
    zero: torch.Tensor
    """A scalar 0 that depends on every module's output: add it to the loss (ZeRO-3 needs every
    parameter's gradient on every rank, also where a rank's share of a module's work is empty)."""


class FlexUlyssesLM(torch.nn.Module):
    """HF causal LM + FlexUlysses: `forward(batch, with_entropy=False) -> TokenOutputs`."""

    def __init__(self, hf_model, attention=None, vision_group=None, logits_chunk: int | None = None, zero_group=None,
                 temperature: float = 1.0, vision_attention: str = "varlen",
                 logits_chunk_bytes: int = logprob_chunks.DEFAULT_CHUNK_BYTES):
        """attention: a FlexUlyssesAttention (default one with overlap). vision_group: the SP domain's
        process group for the vision embedding exchange (`GroupTree.domain_group`; None: the default
        group, which only fits a job of one domain: a mismatch raises at the exchange). logits_chunk_bytes:
        the byte budget of one lm_head chunk's (tokens, vocab) working set, with and without grad
        (`flexrl.sp.logprob_chunk_bytes`; models/logprob_chunks.py); logits_chunk: at most this many
        tokens per chunk besides (None: the budget alone decides).
        zero_group: the group over which lm_head's weight is partitioned (ZeRO-3; set by
        `zero3.build_engine`): every rank of it runs the same number of chunks. None: no such sync.
        temperature: the logits are divided by it before the log-softmax (the rollout's sampling
        temperature, so the log-probs are those of the distribution the samples came from).
        vision_attention: the vision tower's, "varlen" (one call per layer) or "sdpa" (transformers'
        per-window calls); see models/hf_adapter.py."""
        super().__init__()
        if logits_chunk is not None and logits_chunk < 1:
            raise ValueError(f"logits_chunk: must be at least 1, got {logits_chunk}")
        if logits_chunk_bytes < 1:
            raise ValueError(f"logits_chunk_bytes: must be at least 1, got {logits_chunk_bytes}")
        if not temperature > 0:
            raise ValueError(f"temperature: must be > 0, got {temperature}")
        self.logits_chunk = logits_chunk
        self.logits_chunk_bytes = logits_chunk_bytes
        self.temperature = temperature
        self.zero_group = zero_group
        self.last_router_stats: RouterStats | None = None
        """A sparse decoder's `moe.RouterStats` over this rank's tokens in the latest forward (its
        router's auxiliary loss, models/moe.py); None for a dense model."""
        self.unread_config_keys: tuple[str, ...] = ()
        """Keys of the DeepSpeed config DeepSpeed never read (set by `zero3.build_engine`)."""
        self.hf_model = hf_adapter.use_flex_ulysses(hf_model, vision_attention)
        self.family = family_of(hf_model.config)
        self.attention = attention if attention is not None else FlexUlyssesAttention()
        self.vision_group = vision_group

    def embed(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor, DecoderExtras | None]:
        """Local input embeddings with routed vision embeddings in place; the zero term; and the
        decoder's extra vision inputs (DeepStack rows in local token order), None where the family has none."""
        embed_tokens = self.hf_model.get_input_embeddings()
        device = embed_tokens.weight.device
        ids = batch.input_ids
        if ids.numel() == 0:  # idle rank: one placeholder token keeps the embedding in the graph
            ids = torch.zeros(1, dtype=torch.long)
        embeds = embed_tokens(to_device(ids, device))
        zero = embeds.new_zeros(())
        if batch.route is None:
            return embeds, zero, None
        visual = self.family.vision_tower(self.hf_model)
        merge = self.hf_model.config.vision_config.spatial_merge_size
        with region("vision_tower"):  # its forward; a profile's backward ops are not regions
            rows, zero = encode_and_route(visual, batch.route, batch.items, self.vision_group, merge,
                                          self.family.encode_vision, self.family.vision_call_inputs)
        index = to_device(batch.route.recv_local_index, device)
        hidden = embeds.shape[-1]
        embeds = embeds.index_copy(0, index, rows[:, :hidden].to(embeds.dtype))
        return embeds, zero, self._extras(rows[:, hidden:], index, embeds)

    def _extras(self, extra_rows: torch.Tensor, index: torch.Tensor, embeds: torch.Tensor) -> DecoderExtras | None:
        """The family's extra rows (k levels side by side) as a local vision mask and k tensors in local order."""
        levels = self.family.num_extra_features(self.hf_model.config)
        if levels == 0:
            return None
        mask = torch.zeros(embeds.shape[0], dtype=torch.bool, device=embeds.device)
        mask[index] = True
        ordered = extra_rows.index_select(0, torch.argsort(index)).to(embeds.dtype)
        return DecoderExtras(mask.unsqueeze(0), list(ordered.chunk(levels, dim=-1)))

    def forward(self, batch: StepBatch, with_entropy: bool = False, entropy_grad: bool = True) -> TokenOutputs:
        """Target log-probs of the local tokens (and their distributions' entropy with `with_entropy`:
        differentiable with `entropy_grad`, else a statistic computed without a graph, which spares
        a backward through the (tokens, vocab) softmax)."""
        embeds, zero, extras = self.embed(batch)
        idle = batch.layout.num_local_tokens == 0
        positions = batch.position_ids
        if idle:  # one placeholder token at position 0 runs every module (ZeRO-3 gathers are collective)
            positions = torch.zeros((*positions.shape[:-1], 1), dtype=torch.long)
        step = hf_adapter.FlexStep(batch.layout, self.attention, idle=idle)
        positions = to_device(positions, embeds.device)
        with region("decoder"):
            output = self.family.run_decoder(self.hf_model, embeds.unsqueeze(0), positions, extras,
                                             **{hf_adapter.STEP_KWARG: step})
        hidden, router = output.last_hidden_state[0], self.family.router_logits(output)
        router = None if router is None else router_stats(router, self.family.router_top_k(self.hf_model.config),
                                                          0 if idle else None)
        if idle:
            zero = zero + hidden.float().sum() * 0.0
            hidden = hidden[:0]
        with region("lm_head"):
            logprobs, entropy = self._response_outputs(hidden, batch, with_entropy, entropy_grad)
        zero = zero + logprobs.sum() * 0.0 + (entropy.sum() * 0.0 if entropy is not None else 0.0)
        if not bool(batch.response_mask.any()):  # no row reached lm_head: the decoder's gradient still must
            zero = zero + hidden.float().sum() * 0.0
        self.last_router_stats = router
        return TokenOutputs(logprobs, entropy, zero)

    def chunk_tokens(self, logits_dtype: torch.dtype) -> int:
        """Tokens per lm_head chunk: the most whose working set fits `logits_chunk_bytes`, at most
        `logits_chunk`."""
        vocab = self.hf_model.get_output_embeddings().weight.shape[0]
        size = logprob_chunks.chunk_tokens(self.logits_chunk_bytes, vocab, logits_dtype)
        return min(size, self.logits_chunk) if self.logits_chunk is not None else size

    def num_chunks(self, num_tokens: int, size: int, device=None) -> int:
        """lm_head chunks of `size` tokens this rank runs: its own count (at least 1: every module runs
        on every rank), or the maximum over `zero_group`."""
        count = max(1, -(-num_tokens // size))
        if self.zero_group is None or not dist.is_initialized() or dist.get_world_size(self.zero_group) == 1:
            return count  # (one rank: no collective, no wait for the device)
        value = torch.tensor([count], dtype=torch.long)
        value = to_device(value, device) if device is not None else value
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.zero_group)
        return int(value.item())

    def _response_outputs(self, hidden, batch: StepBatch, with_entropy: bool, entropy_grad: bool = True):
        """`_token_outputs` at the response rows only (`batch.response_mask`: all that the losses and the
        log-prob passes read), placed back into (local,) tensors holding 0 at every other row: the
        prompt's and the vision placeholders' hidden states never go through the vocabulary-sized head."""
        rows = to_device(batch.response_mask.nonzero().squeeze(1), hidden.device)
        targets = to_device(batch.targets, hidden.device).index_select(0, rows)
        logprobs, entropy = self._token_outputs(hidden.index_select(0, rows), targets, with_entropy, entropy_grad)

        def placed(values: torch.Tensor) -> torch.Tensor:
            return values.new_zeros(hidden.shape[0]).index_copy(0, rows, values)
        return placed(logprobs), (placed(entropy) if entropy is not None else None)

    def _token_outputs(self, hidden, targets, with_entropy: bool, entropy_grad: bool = True):
        """Per-token target log-probs (and entropy), `chunk_tokens` tokens at a time."""
        size = self.chunk_tokens(hidden.dtype)
        count = self.num_chunks(hidden.shape[0], size, hidden.device)
        # split, not a slice per chunk: the backward is one concatenation, not a full-size zero-filled
        # gradient per chunk; ranks short of the group's chunk count run empty chunks
        hidden_pieces, target_pieces = list(hidden.split(size)), list(targets.split(size))
        hidden_pieces += [hidden[:0]] * (count - len(hidden_pieces))
        target_pieces += [targets[:0]] * (count - len(target_pieces))
        outs = []
        for piece in zip(hidden_pieces, target_pieces):
            if torch.is_grad_enabled():  # backward recomputes this chunk's logits, one chunk at a time
                outs.append(checkpoint(self._chunk, *piece, with_entropy, entropy_grad, use_reentrant=False))
            else:
                outs.append(self._chunk(*piece, with_entropy, entropy_grad))
        logprobs = torch.cat([lp for lp, _ in outs])
        return logprobs, (torch.cat([ent for _, ent in outs]) if with_entropy else None)

    def _chunk(self, hidden, targets, with_entropy: bool, entropy_grad: bool = True):
        logprobs, entropy = logprob_chunks.target_logprobs(self.hf_model.lm_head(hidden), targets, self.temperature,
                                                           with_entropy, entropy_grad)
        return logprobs.float(), (entropy.float() if entropy is not None else None)


def reference_logprobs(model, sample, temperature: float = 1.0) -> torch.Tensor:
    """Plain single-process HF log-probs of a sample's response tokens (model.forward on
    `reference_inputs`, logits divided by `temperature`), on the model's device (the sample's
    tensors are moved there)."""
    device = next(model.parameters()).device
    kwargs = {name: value.to(device) for name, value in reference_inputs(model, sample).items()}
    logits = model(**kwargs).logits[0].float()
    targets = kwargs["input_ids"][0, 1:].unsqueeze(1)
    logprobs = torch.log_softmax(logits[:-1] / temperature, dim=-1).gather(1, targets).squeeze(1)
    return logprobs[sample.response_start - 1:]


def reference_inputs(model, sample) -> dict:
    """What the HF processor would hand the model for one sample (batch of 1), by the model's family
    (`ModelFamily.reference_inputs`): Qwen2.5-VL's with the sequence's mRoPE `position_ids` (3, 1, L) of
    models/positions.py (transformers' own rope index differs across 5.x releases for videos, and the
    trainer, the `hf` engine and vLLM must agree); Qwen3-VL's without (transformers computes its own)."""
    return family_of(model.config).reference_inputs(model, sample)
