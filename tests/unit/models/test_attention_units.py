"""A rank's consecutive degree-1 packs run as one attention call (sp/layout.py `attention_units`,
sp/attention.py): the joined pack covers exactly their tokens, and the attention's output over
several such packs equals causal attention of each sequence alone (a dense float64 reference),
from one call of the local attention."""

from __future__ import annotations

import torch

from flexrl_ds.planning.plan import Pack, Plan
from flexrl_ds.sp.attention import FlexUlyssesAttention
from flexrl_ds.sp.layout import build_rank_layout
from flexrl_ds.sp.local_attention import sdpa_varlen


def _plan(world_size: int, packs: list[tuple[int, tuple[int, ...], tuple[str, ...]]]) -> Plan:
    """Packs (degree, ranks, sequences) in the given (HSF) order on every rank they name."""
    built = tuple(Pack(id=i, degree=d, ranks=r, sequences=s) for i, (d, r, s) in enumerate(packs))
    order = {rank: tuple(p.id for p in built if rank in p.ranks) for rank in range(world_size)}
    return Plan(world_size=world_size, p_max=max(d for d, _, _ in packs), packs=built, rank_order=order)


LENGTHS = {"wide": 9, "a": 5, "b": 3, "c": 4, "d": 2, "e": 6}


def test_consecutive_degree_one_packs_become_one_unit():
    plan = _plan(2, [(2, (0, 1), ("wide",)), (1, (0,), ("a", "b")), (1, (0,), ("c",)), (1, (0,), ("d",)),
                     (1, (1,), ("e",))])
    layout = build_rank_layout(plan, LENGTHS, 0)
    units = layout.attention_units
    assert [(pack.degree, count) for pack, count in units] == [(2, 1), (1, 3)]
    joined = units[1][0]
    assert joined.sequence_ids == ("a", "b", "c", "d")
    assert joined.cu_seqlens == (0, 5, 8, 12, 14) and joined.max_seqlen == 5
    assert joined.local_offset == layout.packs[1].local_offset
    assert joined.local_offset + joined.num_local_tokens == layout.num_local_tokens
    assert joined.segments() == [s for pack in layout.packs[1:] for s in pack.segments()]
    other = build_rank_layout(plan, LENGTHS, 1)
    assert [count for _, count in other.attention_units] == [1, 1]


def _dense_causal(q, k, v, lengths):
    """Each sequence alone: softmax(q kᵀ / √d + causal mask) v in float64, KV heads repeated."""
    outs, start = [], 0
    repeat = q.shape[1] // k.shape[1]
    for length in lengths:
        qs, ks, vs = (t[start:start + length].double().transpose(0, 1) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(repeat, 0), vs.repeat_interleave(repeat, 0)
        scores = qs @ ks.transpose(1, 2) / q.shape[2] ** 0.5
        scores = scores.masked_fill(torch.triu(torch.ones(length, length, dtype=torch.bool), 1), float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += length
    return torch.cat(outs)


def test_joined_packs_attend_each_sequence_alone_in_one_call():
    plan = _plan(1, [(1, (0,), ("a", "b")), (1, (0,), ("c",)), (1, (0,), ("d", "e"))])
    layout = build_rank_layout(plan, {s: n for s, n in LENGTHS.items() if s != "wide"}, 0)
    calls = []

    def counted(q, k, v, cu_seqlens, max_seqlen, scaling):
        calls.append(tuple(cu_seqlens))
        return sdpa_varlen(q, k, v, cu_seqlens, max_seqlen, scaling)

    tokens = layout.num_local_tokens
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, 4, 8, generator=generator, requires_grad=True)
    k, v = (torch.randn(tokens, 2, 8, generator=generator, requires_grad=True) for _ in range(2))
    attention = FlexUlyssesAttention(local_attention=counted, overlap=True)
    out = attention(q, k, v, layout)
    lengths = [LENGTHS[s] for pack in layout.packs for s in pack.sequence_ids]
    torch.testing.assert_close(out.double(), _dense_causal(q, k, v, lengths), atol=1e-5, rtol=1e-5)
    assert calls == [(0, 5, 8, 12, 14, 20)]
    assert attention.last_paths == ["local"] * 3
    # Gradients equal the dense reference's. (A sequence's first token attends one key with weight
    # 1, so its q-gradient is exactly zero: checking "non-zero" would pass only by rounding.)
    weights = torch.randn(out.shape, generator=generator, dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * weights).sum(), (q, k, v))
    expected = torch.autograd.grad((_dense_causal(q, k, v, lengths) * weights).sum(), (q, k, v))
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want.to(got.dtype), atol=1e-5, rtol=1e-5)
