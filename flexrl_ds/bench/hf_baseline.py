"""The update as a careful user writes it with plain transformers: `flexrl bench update`'s `hf_batched` way.

No FlexRL module, no DeepSpeed: the samples sorted by length (longest first) and cut into padded
micro-batches whose padded size (rows × longest row) stays under a token budget; right padding
with an attention mask, the model's own attention (sdpa, transformers' default); the layers
under transformers' activation checkpointing where the bench asks for it (a user fitting a 3B
model on one card turns it on); the loss from the decoder's last hidden states, the response
positions only, `chunk_tokens` of them at a time through lm_head and log-softmax, each chunk
recomputed in the backward (torch.utils.checkpoint), so no [tokens × vocabulary] logit block is
ever whole. The loss is the other ways' -(sum of the response tokens' log-probs) / their number,
the gradients adding up over the micro-batches. Media are encoded per sample, as the model's own
forward does (no sharing across a prompt's samples), by the vision tower as transformers runs it
under the model's attention implementation (sdpa: one attention call per window from Python, the
tower's host-bound part on a GPU; `vision_alone_pass` times the tower alone, so that its share is
reported beside the way's). The padded batches are built once, on the device, before any timed run
(a data loader's work, as the other ways' step batches are built once); `use_cache=False` (no KV
cache is wanted in training).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from flexrl_ds.families import family_of
from flexrl_ds.models.flex_model import reference_inputs
from flexrl_ds.parallel.profiling import region


def padded_micro_batches(lengths: dict[str, int], budget_tokens: int) -> list[list[str]]:
    """Sample names longest first, cut greedily: a batch takes the next sample while its rows ×
    its longest row stay within `budget_tokens` (a sample longer than the budget is a batch alone)."""
    if budget_tokens < 1:
        raise ValueError(f"hf_batch_tokens: must be at least 1, got {budget_tokens}")
    batches: list[list[str]] = []
    for name in sorted(lengths, key=lambda n: (-lengths[n], n)):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget_tokens:
            batches[-1].append(name)
        else:
            batches.append([name])
    return batches


def padded_inputs(model, samples: list) -> tuple[dict[str, torch.Tensor], list[tuple[int, int]]]:
    """One right-padded batch of `samples` for the HF model (input ids, attention mask, mRoPE
    positions, media concatenated in row order), and each row's (response start, length)."""
    rows = [reference_inputs(model, sample) for sample in samples]
    width = max(sample.length for sample in samples)
    batch: dict[str, Any] = {}
    batch["input_ids"] = torch.stack([_pad(row["input_ids"][0], width) for row in rows])
    batch["attention_mask"] = torch.stack([_pad(torch.ones(s.length, dtype=torch.long), width) for s in samples])
    if "position_ids" in rows[0]:  # Qwen2.5-VL's (models/positions.py); Qwen3-VL's come from transformers
        batch["position_ids"] = torch.stack([_pad(row["position_ids"][:, 0], width) for row in rows], dim=1)
    if "mm_token_type_ids" in rows[0]:
        batch["mm_token_type_ids"] = torch.stack([_pad(row["mm_token_type_ids"][0], width) for row in rows])
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        parts = [row[key] for row in rows if key in row]
        if parts:
            batch[key] = torch.cat(parts)
    return batch, [(sample.response_start, sample.length) for sample in samples]


def _pad(values: torch.Tensor, width: int) -> torch.Tensor:
    """`values` right-padded with zeros along its last dimension to `width`."""
    return torch.nn.functional.pad(values, (0, width - values.shape[-1]))


def chunked_target_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                            temperature: float, chunk_tokens: int) -> torch.Tensor:
    """log-softmax(lm_head(hidden) / temperature)[targets] per row, `chunk_tokens` rows at a time,
    each chunk's logits recomputed in the backward instead of kept."""
    def one_chunk(states: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        logits = lm_head(states).float() / temperature
        return logits.gather(1, wanted[:, None]).squeeze(1) - torch.logsumexp(logits, dim=-1)

    pieces = [checkpoint(one_chunk, states, wanted, use_reentrant=False) if torch.is_grad_enabled()
              else one_chunk(states, wanted)
              for states, wanted in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens))]
    return torch.cat(pieces)


def prepared_batches(model, samples: dict[str, Any], budget_tokens: int) -> list[tuple[dict, list]]:
    """Each padded micro-batch's inputs on the model's device and its rows' (response start, length)."""
    device = next(model.parameters()).device
    prepared = []
    for names in padded_micro_batches({name: sample.length for name, sample in samples.items()}, budget_tokens):
        inputs, spans = padded_inputs(model, [samples[name] for name in names])
        prepared.append(({key: value.to(device) for key, value in inputs.items()}, spans))
    return prepared


def batched_response_logprobs(model, inputs: dict[str, torch.Tensor], spans: list[tuple[int, int]],
                              temperature: float, chunk_tokens: int) -> torch.Tensor:
    """The response tokens' log-probs of one padded micro-batch (`padded_inputs` on the model's
    device; rows in order, each row's response positions in order), through the model once (its
    vision tower inside) and lm_head in chunks."""
    with region("decoder"):  # the trainer's region names: a profile compares them (forward only)
        hidden = model.model(**inputs, use_cache=False).last_hidden_state
    # Position t predicts token t + 1: a row's response tokens [start, length) from [start - 1, length - 1).
    states = torch.cat([hidden[row, start - 1:length - 1] for row, (start, length) in enumerate(spans)])
    targets = torch.cat([inputs["input_ids"][row, start:length] for row, (start, length) in enumerate(spans)])
    with region("lm_head"):
        return chunked_target_logprobs(model.get_output_embeddings(), states, targets, temperature, chunk_tokens)


def hf_batched_pass(model, samples: dict[str, Any], temperature: float, budget_tokens: int,
                    chunk_tokens: int = 4096) -> Callable[[], float]:
    """The bench's `hf_batched` way (module docstring): per padded micro-batch, forward, loss,
    backward; returns the summed loss of a run."""
    prepared = prepared_batches(model, samples, budget_tokens)
    count = sum(sample.length - sample.response_start for sample in samples.values())

    def run() -> float:
        model.zero_grad(set_to_none=True)
        total = 0.0
        for inputs, spans in prepared:
            logprobs = batched_response_logprobs(model, inputs, spans, temperature, chunk_tokens)
            loss = -logprobs.float().sum() / count
            with region("backward"):
                loss.backward()
            total += float(loss.detach())
        return total
    return run


MEDIA_KEYS = (("pixel_values", "image_grid_thw"), ("pixel_values_videos", "video_grid_thw"))
"""(pixels, grids) input names of each media kind, as the HF processor names them."""


def media_groups(model, batches: list[list]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per micro-batch (a list of samples), the (pixels, grids) of each media kind its samples hold
    (one tower call per kind, as transformers' forward makes), on the model's device."""
    device = next(model.parameters()).device
    groups = []
    for samples in batches:
        inputs, _ = padded_inputs(model, samples) if samples else ({}, [])
        groups.append([(inputs[pixels].to(device), inputs[grids].to(device))
                       for pixels, grids in MEDIA_KEYS if pixels in inputs])
    return groups


def vision_alone_pass(model, groups: list[list[tuple[torch.Tensor, torch.Tensor]]]) -> Callable[[], float]:
    """The vision tower alone over `groups` (media_groups), forward and backward (of the merged
    rows' sum: the same work as any loss's), under the model's current vision attention and
    checkpointing: what the tower costs inside a way whose micro-batches encode these media."""
    family = family_of(model.config)
    visual = family.vision_tower(model)

    def run() -> float:
        model.zero_grad(set_to_none=True)
        total = 0.0
        for group in groups:
            for pixels, grids in group:
                with region("vision_tower"):
                    rows, _ = family.encode_vision(visual, pixels, grids)
                total_rows = rows.float().sum()
                with region("backward"):
                    total_rows.backward()
                total += float(total_rows.detach())
        return total
    return run


@contextlib.contextmanager
def vision_tower_region(model) -> Iterator[None]:
    """While inside, each forward of the model's vision tower is the profile region
    `flexrl/vision_tower` (forward hooks, removed on exit): transformers calls the tower from inside
    the model's forward, so hf_batched's `decoder` region holds it; a text model has none."""
    visual = family_of(model.config).vision_tower(model)
    if visual is None:
        yield
        return
    open_regions: list = []

    def enter(_module, _args):
        open_regions.append(region("vision_tower"))
        open_regions[-1].__enter__()

    def leave(_module, _args, _output):
        open_regions.pop().__exit__(None, None, None)

    handles = [visual.register_forward_pre_hook(enter), visual.register_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
