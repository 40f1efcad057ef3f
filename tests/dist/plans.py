"""Random valid FlexUlysses plans and the single-process reference for the dist tests."""

from __future__ import annotations

import random

import torch

from flexrl_ds.sp.local_attention import sdpa_causal_varlen
from flexrl_ds.sp.plan import Pack, Plan, validate_plan


def random_plan(seed: int, world_size: int, p_max: int, max_len: int = 24, max_seqs_per_pack: int = 3):
    """A random valid plan: aligned blocks, degrees 1..p_max, random packs, HSF rank order.

    Returns (plan, seq_lengths). Every rank gets at least one pack.
    """
    rng = random.Random(seed)
    degrees = [d for d in (1, 2, 4, 8, 16) if d <= p_max]
    packs: list[Pack] = []
    lengths: dict[str, int] = {}
    covered: set[int] = set()
    num_packs = rng.randint(world_size // 2 + 1, world_size + 4)
    while len(packs) < num_packs or len(covered) < world_size:
        degree = rng.choice(degrees)
        first = rng.randrange(world_size // degree) * degree
        if len(packs) >= num_packs:  # cover a rank still without work
            first, degree = min(set(range(world_size)) - covered), 1
        seq_ids = []
        for _ in range(rng.randint(1, max_seqs_per_pack)):
            seq_id = f"s{len(lengths)}"
            lengths[seq_id] = rng.randint(1, max_len * (1 + degree // 2))
            seq_ids.append(seq_id)
        ranks = tuple(range(first, first + degree))
        packs.append(Pack(id=len(packs), degree=degree, ranks=ranks, sequences=tuple(seq_ids)))
        covered.update(ranks)
    rank_order = {
        r: tuple(p.id for p in sorted((p for p in packs if r in p.ranks), key=lambda p: (-p.degree, p.id)))
        for r in range(world_size)
    }
    plan = Plan(world_size=world_size, p_max=p_max, packs=tuple(packs), rank_order=rank_order)
    validate_plan(plan, list(lengths))
    return plan, lengths


def sequence_tensors(seed: int, lengths: dict[str, int], num_heads: int, num_kv_heads: int, head_dim: int,
                     dtype=torch.float64):
    """Deterministic q, k, v and output-gradient weights per whole sequence (same on every rank)."""
    out = {}
    for index, (seq_id, length) in enumerate(sorted(lengths.items())):
        gen = torch.Generator().manual_seed(seed * 100003 + index)
        out[seq_id] = {
            "q": torch.randn(length, num_heads, head_dim, generator=gen, dtype=dtype),
            "k": torch.randn(length, num_kv_heads, head_dim, generator=gen, dtype=dtype),
            "v": torch.randn(length, num_kv_heads, head_dim, generator=gen, dtype=dtype),
            "w": torch.randn(length, num_heads, head_dim, generator=gen, dtype=dtype),
        }
    return out


def reference(tensors: dict, scaling=None) -> dict:
    """Single-process causal attention per sequence: out and q/k/v gradients of sum(out * w)."""
    result = {}
    for seq_id, t in tensors.items():
        q, k, v = (t[name].clone().requires_grad_(True) for name in ("q", "k", "v"))
        out = sdpa_causal_varlen(q, k, v, [0, q.shape[0]], q.shape[0], scaling)
        (out * t["w"]).sum().backward()
        result[seq_id] = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return result
