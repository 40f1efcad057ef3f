"""Target log-probs (and entropy) from a chunk of logits, within a stated memory bound.

Each target's log-prob is its logit minus the row's log-sum-exp, `z_t - lse(z)` with `z = logits /
temperature`, computed in fp32 (fp64 for fp64 logits) without the [tokens x vocab] log-softmax that
`torch.log_softmax(...).gather(...)` materialises, and without saving anything of that size for the
backward: `TargetLogprobs` keeps only the per-token `lse` (and entropy) and takes its gradient from the
logits it is given again (the caller's chunk is checkpointed, so they are recomputed one chunk at a
time):

    d logprob_t / d z_j = [j == t] - p_j          d entropy / d z_j = -p_j (log p_j + entropy)

The working set of a chunk of C tokens over a vocabulary of V rows is, at its peak (the backward with a
differentiable entropy): the logits (C x V, their dtype), two C x V buffers of the compute dtype and the
logits' gradient (C x V, their dtype); the forward needs one compute buffer beside the logits.
`bytes_per_logit` is that sum per element and `chunk_tokens` the most tokens whose working set fits a byte
budget (`flexrl.sp.logprob_chunk_bytes`): the log-prob pass then holds at most that budget of
[tokens x vocab] intermediates at any time, on top of its inputs and the LM head's weight gradient,
whatever the vocabulary (tests/unit/models/test_logprob_chunks.py measures it on the CPU allocator).
"""

from __future__ import annotations

import torch

from flexrl_ds.planning.config import SPConfig

DEFAULT_CHUNK_BYTES = SPConfig().logprob_chunk_bytes
"""`flexrl.sp.logprob_chunk_bytes`'s default, 1 GiB: 588 tokens per chunk over a 151,936-row vocabulary
in bf16 (12 bytes per logit)."""


def compute_dtype(logits_dtype: torch.dtype) -> torch.dtype:
    """fp32, or fp64 for fp64 logits."""
    return torch.float64 if logits_dtype == torch.float64 else torch.float32


def bytes_per_logit(logits_dtype: torch.dtype) -> int:
    """Peak bytes a chunk holds per (token, vocabulary row): the logits and their gradient in their
    dtype, two buffers in the compute dtype."""
    logits_size = torch.empty((), dtype=logits_dtype).element_size()
    compute_size = torch.empty((), dtype=compute_dtype(logits_dtype)).element_size()
    return 2 * logits_size + 2 * compute_size


def chunk_tokens(budget_bytes: int, vocab_size: int, logits_dtype: torch.dtype) -> int:
    """The most tokens per chunk whose working set fits `budget_bytes` (at least 1)."""
    if budget_bytes < 1 or vocab_size < 1:
        raise ValueError(f"logprob chunk budget {budget_bytes} bytes and vocabulary {vocab_size} rows: both must "
                         "be positive")
    return max(1, budget_bytes // (vocab_size * bytes_per_logit(logits_dtype)))


class TargetLogprobs(torch.autograd.Function):
    """(logits (C, V), targets (C,), temperature, entropy: 0 none | 1 a statistic | 2 differentiable)
    -> (log-probs (C,), entropy (C,) or an empty tensor), both in the compute dtype.
    Targets below 0 (ignored positions) read column 0, as a clamp would."""

    @staticmethod
    def forward(ctx, logits, targets, temperature: float, entropy: int):
        targets = targets.clamp(min=0).unsqueeze(1)
        shifted = logits.to(compute_dtype(logits.dtype), copy=True)  # the one compute buffer
        if temperature != 1.0:
            shifted.div_(temperature)
        target = shifted.gather(1, targets).squeeze(1)
        row_max = shifted.amax(dim=1, keepdim=True)
        sums = shifted.sub_(row_max).exp_().sum(dim=1)  # exp(z - max), in place
        lse = row_max.squeeze(1) + sums.log()
        out_entropy = logits.new_empty(0, dtype=shifted.dtype)
        if entropy:  # sum_j p_j z_j = sum_j exp(z_j - max) * logits_j / (temperature * sums)
            weighted = shifted.mul_(logits).sum(dim=1)
            out_entropy = lse - weighted / (temperature * sums)
        del shifted
        ctx.temperature, ctx.entropy_grad = temperature, entropy == 2
        ctx.save_for_backward(logits, targets, lse, out_entropy)
        if entropy != 2:
            ctx.mark_non_differentiable(out_entropy)
        return target - lse, out_entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        if grad_logprobs is None:
            grad_logprobs = lse.new_zeros(lse.shape)
        grad = logits.to(lse.dtype, copy=True)
        if temperature != 1.0:
            grad.div_(temperature)
        grad.sub_(lse.unsqueeze(1))  # log p
        if ctx.entropy_grad and grad_entropy is not None:
            # -p_j (g_lp + g_H (log p_j + H)) + [j == t] g_lp
            probs = grad.exp()
            grad.add_(entropy.unsqueeze(1)).mul_(grad_entropy.unsqueeze(1)).add_(grad_logprobs.unsqueeze(1))
            grad.mul_(probs).neg_()
            del probs
        else:  # -p_j g_lp + [j == t] g_lp
            grad.exp_().mul_(grad_logprobs.neg().unsqueeze(1))
        grad.scatter_add_(1, targets, grad_logprobs.unsqueeze(1))
        if temperature != 1.0:
            grad.div_(temperature)
        return grad.to(logits.dtype), None, None, None


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, entropy_grad: bool = True):
    """(log-probs, entropy or None) of `targets` under `logits / temperature`, row by row (see
    `TargetLogprobs`); the entropy has a gradient only with `entropy_grad` and grad mode on."""
    mode = 0 if not with_entropy else (2 if entropy_grad and torch.is_grad_enabled() else 1)
    logprobs, entropy = TargetLogprobs.apply(logits, targets, float(temperature), mode)
    return logprobs, (entropy if with_entropy else None)
