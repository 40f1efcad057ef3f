"""Random valid FlexUlysses plans, the rank function that runs them, and the single-process check.

Shared by tests/distributed (gloo, CPU) and tests/gpu (NCCL): `rank_run_plans` runs on every rank of a
`harness.DistPool`; `check_against_reference` compares what the ranks returned with single-process
causal attention (float64 on CPU) on the same inputs.
"""

from __future__ import annotations

import random

import torch

from harness import cached_group_tree, worker_state

from flexrl_ds.sp.attention import FlexUlyssesAttention
from flexrl_ds.sp.fixed_sp import FixedUlyssesAttention, fixed_sp_plan
from flexrl_ds.sp.layout import build_rank_layout
from flexrl_ds.sp.local_attention import CausalVarlenAttention, pick_backend, sdpa_varlen
from flexrl_ds.planning.plan import Pack, Plan, validate_plan

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {"float64": 1e-11, "float32": 2e-5, "bfloat16": 3e-2}
"""Max abs error allowed, relative to max(1, |reference|) of the compared tensor."""


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
    """Deterministic q, k, v and output-gradient weights per whole sequence (same on every rank).

    Drawn in float64 and rounded to `dtype`, so a float64 reference sees exactly the rounded inputs.
    """
    out = {}
    for index, (seq_id, length) in enumerate(sorted(lengths.items())):
        gen = torch.Generator().manual_seed(seed * 100003 + index)
        out[seq_id] = {
            name: torch.randn(length, heads, head_dim, generator=gen, dtype=torch.float64).to(dtype)
            for name, heads in (("q", num_heads), ("k", num_kv_heads), ("v", num_kv_heads), ("w", num_heads))
        }
    return out


def reference(tensors: dict, scaling=None) -> dict:
    """Single-process causal attention per sequence: out and q/k/v gradients of sum(out * w)."""
    result = {}
    for seq_id, t in tensors.items():
        q, k, v = (t[name].clone().requires_grad_(True) for name in ("q", "k", "v"))
        out = sdpa_varlen(q, k, v, [0, q.shape[0]], q.shape[0], scaling)
        (out * t["w"]).sum().backward()
        result[seq_id] = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    return result


def _local_inputs(layout, tensors, device):
    pieces = {name: layout.slice_tokens({s: t[name] for s, t in tensors.items()}, dim=0).to(device)
              for name in "qkvw"}
    q, k, v = (pieces[name].clone().requires_grad_(True) for name in "qkv")
    return q, k, v, pieces["w"]


def _domain_seed(seed: int, domain: int) -> int:
    return seed * 31 + domain


def _plan_for(seed, domain_size, p_max, max_len, fixed, explicit=None):
    if explicit is not None:  # seeds index a given list of (plan, lengths)
        return explicit[seed // 31]
    plan, lengths = random_plan(seed, domain_size, p_max, max_len=max_len)
    if fixed:
        plan, lengths = fixed_sp_plan(lengths, domain_size, p_max)
    return plan, lengths


def rank_run_plans(seeds, domain_size, p_max, num_heads, num_kv_heads, head_dim, dtype, overlap,
                   use_deepspeed=True, max_len=24, fixed=False, backend="auto", explicit=None):
    """On every rank: run each random plan of its domain; return local out, grads and the paths taken."""
    tree = cached_group_tree(domain_size, p_max)
    device = worker_state()["context"].device
    results = []
    for seed in seeds:
        seed = _domain_seed(seed, tree.domain)
        plan, lengths = _plan_for(seed, domain_size, p_max, max_len, fixed, explicit)
        tensors = sequence_tensors(seed, lengths, num_heads, num_kv_heads, head_dim, DTYPES[dtype])
        layout = build_rank_layout(plan, lengths, tree.local_rank, tree, num_heads=num_heads,
                                   num_kv_heads=num_kv_heads)
        q, k, v, w = _local_inputs(layout, tensors, device)
        local = CausalVarlenAttention(backend)
        attention = FixedUlyssesAttention(local) if fixed else FlexUlyssesAttention(
            local, overlap=overlap, use_deepspeed=use_deepspeed)
        out = attention(q, k, v, layout)
        (out * w).sum().backward()
        paths = attention.backend if fixed else attention.last_paths
        results.append({"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad, "paths": paths,
                        "local_attention": pick_backend(backend, q).__name__})
    return results


def check_against_reference(per_rank, seeds, world_size, domain_size, p_max, num_heads, num_kv_heads,
                            head_dim, dtype, max_len=24, fixed=False, explicit=None, **_):
    """Compare every rank's local results with single-process float64 attention; return the worst error."""
    worst = 0.0
    for index, seed in enumerate(seeds):
        for domain in range(world_size // domain_size):
            dseed = _domain_seed(seed, domain)
            plan, lengths = _plan_for(dseed, domain_size, p_max, max_len, fixed, explicit)
            tensors = sequence_tensors(dseed, lengths, num_heads, num_kv_heads, head_dim, DTYPES[dtype])
            ref = reference({s: {n: t.double() for n, t in ts.items()} for s, ts in tensors.items()})
            for local_rank in range(domain_size):
                layout = build_rank_layout(plan, lengths, local_rank)
                got = per_rank[domain * domain_size + local_rank][index]
                for name in ("out", "dq", "dk", "dv"):
                    expected = layout.slice_tokens({s: r[name] for s, r in ref.items()}, dim=0)
                    assert got[name].shape == expected.shape, (seed, local_rank, name)
                    if not expected.numel():
                        continue
                    error = (got[name].double() - expected).abs().max().item()
                    error /= max(1.0, expected.abs().max().item())
                    worst = max(worst, error)
                    assert error <= TOLERANCE[dtype], (
                        f"plan seed {seed}, domain {domain}, rank {local_rank}, {name}: error {error:.3g}")
    return worst
