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
forward does (no sharing across a prompt's samples).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils.checkpoint import checkpoint

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
    if "position_ids" in rows[0]:
        batch["position_ids"] = torch.stack([_pad(row["position_ids"][:, 0], width) for row in rows], dim=1)
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


def batched_response_logprobs(model, samples: list, temperature: float, chunk_tokens: int) -> torch.Tensor:
    """The response tokens' log-probs of one padded micro-batch (rows in order, each row's response
    positions in order), through the decoder once and lm_head in chunks."""
    device = next(model.parameters()).device
    inputs, spans = padded_inputs(model, samples)
    inputs = {name: value.to(device) for name, value in inputs.items()}
    with region("decoder"):  # the trainer's region names: a profile compares them (forward only)
        hidden = model.model(**inputs).last_hidden_state
    # Position t predicts token t + 1: a row's response tokens [start, length) from [start - 1, length - 1).
    states = torch.cat([hidden[row, start - 1:length - 1] for row, (start, length) in enumerate(spans)])
    targets = torch.cat([inputs["input_ids"][row, start:length] for row, (start, length) in enumerate(spans)])
    with region("lm_head"):
        return chunked_target_logprobs(model.get_output_embeddings(), states, targets, temperature, chunk_tokens)


def hf_batched_pass(model, samples: dict[str, Any], temperature: float, budget_tokens: int,
                    chunk_tokens: int = 4096) -> Callable[[], float]:
    """The bench's `hf_batched` way (module docstring): per padded micro-batch, forward, loss,
    backward; returns the summed loss of a run."""
    batches = padded_micro_batches({name: sample.length for name, sample in samples.items()}, budget_tokens)
    count = sum(sample.length - sample.response_start for sample in samples.values())

    def run() -> float:
        model.zero_grad(set_to_none=True)
        total = 0.0
        for names in batches:
            logprobs = batched_response_logprobs(model, [samples[n] for n in names], temperature, chunk_tokens)
            loss = -logprobs.float().sum() / count
            loss.backward()
            total += float(loss.detach())
        return total
    return run
