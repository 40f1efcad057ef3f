"""The router's auxiliary (load-balancing) loss of a sparse MoE decoder under FlexUlysses.

transformers' `load_balancing_loss_func` (Qwen3-VL MoE, 5.25): over every router row N (tokens x sparse
layers), with `count_e` the top-k selections of expert e and `prob_e` the summed softmax probability of e,

    aux = num_experts * sum_e (count_e / N) * (prob_e / N).

A rank holds only its local tokens, so `router_stats` keeps the three sums of its rows, and
`router_aux_term` all-reduces them (detached) over the ranks that together hold the pass's tokens:
the reported value is the global one. Its gradient flows only through prob (the counts come from a
top-k), linearly, so each rank's term `num_experts * sum_e (count_e / N) * (local prob_e / N)` has this
rank's share of the global gradient, and the terms sum to the global value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class RouterStats:
    """Sums over one rank's router rows (tokens x sparse layers) of one forward."""

    counts: torch.Tensor
    """(experts,) top-k selections of each expert (no gradient)."""
    probs: torch.Tensor
    """(experts,) summed routing probabilities (differentiable)."""
    rows: torch.Tensor
    """() router rows counted."""
    top_k: int


def router_stats(router_logits, top_k: int, num_rows: int | None = None) -> RouterStats:
    """Sums of a forward's router logits (one (tokens, experts) tensor per sparse layer); only the first
    `num_rows` tokens of each count (None: all; 0: an idle rank's placeholder token)."""
    experts = router_logits[0].shape[-1]
    device = router_logits[0].device
    counts = torch.zeros(experts, dtype=torch.float32, device=device)
    probs = torch.zeros(experts, dtype=torch.float32, device=device)
    rows = 0
    for logits in router_logits:
        logits = logits if num_rows is None else logits[:num_rows]
        weights = torch.softmax(logits.float(), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        counts = counts + torch.bincount(chosen, minlength=experts).float()
        probs = probs + weights.sum(dim=0)
        rows += logits.shape[0]
    # a fill on the device, not a copy from the host (which would wait for the device's queue)
    return RouterStats(counts.detach(), probs, counts.new_full((), float(rows)), top_k)


def router_aux_term(stats: RouterStats, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's differentiable term, the global auxiliary loss, a detached 0-d float64 tensor) over
    the ranks of `group` (collective: every rank of the group calls it; None: the default group, or no
    collective where torch.distributed is not initialised). Nothing is read back to the host."""
    totals = torch.cat([stats.counts, stats.probs.detach(), stats.rows.view(1)]).double()
    if dist.is_initialized():
        dist.all_reduce(totals, group=group)
    experts = stats.counts.shape[0]
    counts, probs, rows = totals[:experts], totals[experts:2 * experts], totals[-1].clamp_min(1.0)
    value = experts * (counts / rows * probs / rows).sum()
    term = experts * ((counts / rows).to(stats.probs.dtype) * stats.probs / rows.to(stats.probs.dtype)).sum()
    return term, value
