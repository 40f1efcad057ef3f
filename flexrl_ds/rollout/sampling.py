"""Seeded token sampling: each batch row draws from its own random stream, so a sample's tokens do not
depend on the other rows of its batch.

A row's stream is `max_new_tokens` uniforms drawn up front from `torch.Generator().manual_seed(seed)`
(CPU, float64): decoding step t of that row consumes uniform t and nothing else, whatever the batch
size, the row's position or how many other rows have finished. A token is drawn by inverting the
cumulative distribution of the filtered probabilities (temperature, then top-k, then top-p) at that
uniform; only top-k / top-p sort the vocabulary (plain temperature sampling inverts it in vocabulary
order). The draw is a function of the row's logits: where the computed logits themselves depend on the
batch (bf16 GEMMs on a GPU pick kernels by shape), a token near a CDF boundary can still flip.

`SeededSampler` is a transformers `LogitsProcessor`: it samples the next token itself and returns
scores that leave only that token finite, so `generate` run greedily (do_sample=False) emits it. It
also records the model's log-probability of each chosen token under the logits divided by the
temperature (1 for greedy), before top-k / top-p: what the trainer computes for the same token.
"""

from __future__ import annotations

from typing import Sequence

import torch
from transformers import LogitsProcessor

from flexrl_ds.rollout.base import SamplingParams


def row_uniforms(seeds: Sequence[int], num_steps: int) -> torch.Tensor:
    """(rows, num_steps) float64 uniforms in [0, 1): row r is the stream of seeds[r]."""
    streams = [torch.rand(num_steps, generator=torch.Generator().manual_seed(int(seed)), dtype=torch.float64)
               for seed in seeds]
    return torch.stack(streams)


def sample_tokens(logits_BV: torch.Tensor, uniforms_B: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(B,) token ids: row b drawn from its filtered distribution at uniform uniforms_B[b].

    Greedy (temperature 0) takes the argmax and ignores the uniforms.
    """
    if params.suppressed_token_ids:
        logits_BV = logits_BV.float().index_fill(-1, torch.tensor(params.suppressed_token_ids,
                                                                  device=logits_BV.device), float("-inf"))
    if params.greedy:
        return logits_BV.argmax(dim=-1)
    scaled = logits_BV.float() / params.temperature
    indices = None
    if 0 < params.top_k < scaled.shape[-1]:
        scaled, indices = torch.topk(scaled, params.top_k, dim=-1)
    elif params.top_p < 1:
        scaled, indices = torch.sort(scaled, dim=-1, descending=True, stable=True)
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1:  # probs are sorted here: keep a token while the mass before it is below top_p
        mass_before = torch.cumsum(probs, dim=-1) - probs
        probs = torch.where(mass_before < params.top_p, probs, torch.zeros_like(probs))
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = uniforms_B.to(cdf.device, cdf.dtype).unsqueeze(-1) * cdf[:, -1:]
    position = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[-1] - 1)
    return position.squeeze(-1) if indices is None else indices.gather(-1, position).squeeze(-1)


class SeededSampler(LogitsProcessor):
    """Samples each row's next token from its own stream; for one `generate` call over len(seeds) rows."""

    def __init__(self, seeds: Sequence[int], params: SamplingParams):
        self.params = params
        self.uniforms = None if params.greedy else row_uniforms(seeds, params.max_new_tokens)
        self.num_rows = len(seeds)
        self.tokens: list[torch.Tensor] = []
        """Per decoding step, (rows,) chosen token ids (also for rows already finished: ignore those)."""
        self.logprobs: list[torch.Tensor] = []
        """Per decoding step, (rows,) float32 log-probability of the chosen token (logits / temperature)."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = len(self.tokens)
        assert scores.shape[0] == self.num_rows and step < self.params.max_new_tokens, (scores.shape, step)
        uniforms = None
        if self.uniforms is not None:
            if self.uniforms.device != scores.device:
                self.uniforms = self.uniforms.to(scores.device)
            uniforms = self.uniforms[:, step]
        chosen = sample_tokens(scores, uniforms, self.params)
        temperature = 1.0 if self.params.greedy else self.params.temperature
        logprobs = torch.log_softmax(scores.float() / temperature, dim=-1).gather(-1, chosen.unsqueeze(-1)).squeeze(-1)
        self.tokens.append(chosen)
        self.logprobs.append(logprobs)
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(-1, chosen.unsqueeze(-1), 0.0)

    def results(self, eos_token_ids: Sequence[int]) -> list[tuple[list[int], list[float], str]]:
        """Per row: its response (cut after its first EOS), its log-probs and its finish reason."""
        if not self.tokens:
            return [([], [], "length") for _ in range(self.num_rows)]
        all_tokens = torch.stack(self.tokens, dim=1).tolist()
        all_logprobs = torch.stack(self.logprobs, dim=1).tolist()
        return [_cut(tokens, logprobs, set(eos_token_ids), self.params.max_new_tokens)
                for tokens, logprobs in zip(all_tokens, all_logprobs)]


def _cut(tokens: list[int], logprobs: list[float], eos: set[int], max_new_tokens: int):
    for position, token in enumerate(tokens):
        if token in eos:
            return tokens[:position + 1], logprobs[:position + 1], "stop"
    assert len(tokens) == max_new_tokens, (len(tokens), max_new_tokens)
    return tokens, logprobs, "length"
