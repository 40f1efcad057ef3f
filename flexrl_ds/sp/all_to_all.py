"""Ulysses all-to-alls for one pack: sequence shards <-> head subsets, with autograd.

Two implementations, one contract (same head partition, same token order):

1. **DeepSpeed's** `deepspeed.sequence.layer._SeqAllToAll.apply(group, x, scatter_idx, gather_idx,
   batch_dim_idx)` — its group is a per-call argument, so it serves a group that changes per pack. It
   is used when it fits: every rank of the pack holds the same number of tokens, the query and KV head
   counts divide by the degree, the exchange is synchronous, and `deepspeed.comm` is initialized.
2. **Our own** exchange on `torch.distributed.all_to_all_single` (`PackExchange`) for everything
   DeepSpeed's primitives do not admit, and why:
   - uneven token shards (a pack of T tokens on d ranks with T % d != 0): DeepSpeed reshapes the
     gathered sequence as [d, T/d] and needs equal shards;
   - uneven heads (28 heads at d=8): `uneven_heads_all2all` reads the rank from DeepSpeed's single
     global sequence-parallel group (`groups._get_sequence_parallel_rank()`), not from the pack's group;
   - KV heads fewer than the degree: DeepSpeed asserts num_kv_heads >= degree; here KV heads are
     replicated to every rank whose query heads use them (the backward sums the replicas' gradients);
   - overlap: DeepSpeed's forward exchange is synchronous; ours can be issued asynchronously (q, k
     and v merged into ONE collective per pack), waited for just before the pack's attention.
   The same code runs on gloo and NCCL (async handles on both: NCCL runs them on its own stream).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from flexrl_ds.planning.heads import HeadSlice, head_partition  # noqa: F401  (the executor's head split)


class _AllToAllFlat(torch.autograd.Function):
    """all_to_all_single on flat buffers with per-rank split sizes; backward swaps the splits.

    With `pending` given, the forward is issued asynchronously and the handle stored on `pending`;
    the returned buffer must not be read before `pending.work.wait()`.
    """

    @staticmethod
    def forward(ctx, send, group, send_splits, recv_splits, pending):
        ctx.group, ctx.send_splits, ctx.recv_splits = group, send_splits, recv_splits
        recv = send.new_empty(sum(recv_splits))
        work = dist.all_to_all_single(recv, send.contiguous(), list(recv_splits), list(send_splits),
                                      group=group, async_op=pending is not None)
        if pending is not None:
            pending.work = work
        return recv

    @staticmethod
    def backward(ctx, grad_recv):
        grad_send = grad_recv.new_empty(sum(ctx.send_splits))
        dist.all_to_all_single(grad_send, grad_recv.contiguous(), list(ctx.send_splits), list(ctx.recv_splits),
                               group=ctx.group)
        return grad_send, None, None, None, None


class PendingHeads:
    """An issued sequence->head exchange; `wait()` gives the pack's full tokens for this rank's heads."""

    def __init__(self):
        self.work = None
        """The async collective's handle (None: already complete)."""
        self.post = None
        """Turns the received buffer into (q, k, v); set once the exchange is issued."""

    def wait(self):
        if self.work is not None:
            self.work.wait()
        return self.post()


def issue_seq_to_heads(q, k, v, group, shard_sizes: Sequence[int], heads: Sequence[HeadSlice],
                       rank_in_group: int, async_op: bool) -> PendingHeads:
    """Sequence-gather / head-scatter of one pack's q, k, v shards in ONE collective.

    q (n_i, H, D), k/v (n_i, K, D) are this rank's shard; after `wait()`: q (T, h_me, D), k/v
    (T, k_me, D) with T the pack's tokens in order and h_me/k_me this rank's `heads[rank_in_group]`.
    """
    num_local, head_dim = q.shape[0], q.shape[2]
    assert num_local == shard_sizes[rank_in_group], "shard size differs from the layout"
    chunks = []
    for part, q_part in zip(heads, _query_parts(q, heads)):
        chunks += [q_part.reshape(-1), k[:, part.kv_start:part.kv_end].reshape(-1),
                   v[:, part.kv_start:part.kv_end].reshape(-1)]
    send = torch.cat(chunks)
    send_splits = [num_local * (p.num_q + 2 * p.num_kv) * head_dim for p in heads]
    mine = heads[rank_in_group]
    recv_splits = [n * (mine.num_q + 2 * mine.num_kv) * head_dim for n in shard_sizes]
    holder = PendingHeads()
    recv = _AllToAllFlat.apply(send, group, tuple(send_splits), tuple(recv_splits), holder if async_op else None)

    def post():
        qs, ks, vs = [], [], []
        for n, piece in zip(shard_sizes, recv.split(recv_splits)):
            q_part, k_part, v_part = piece.split([n * mine.num_q * head_dim, n * mine.num_kv * head_dim,
                                                  n * mine.num_kv * head_dim])
            qs.append(q_part.view(n, mine.num_q, head_dim))
            ks.append(k_part.view(n, mine.num_kv, head_dim))
            vs.append(v_part.view(n, mine.num_kv, head_dim))
        return torch.cat(qs), torch.cat(ks), torch.cat(vs)

    holder.post = post
    return holder


def _query_parts(q, heads: Sequence[HeadSlice]):
    """q's head slices of `heads`: one split where they tile the heads in order (its backward is one
    concatenation; a slice each would zero-fill a q-sized gradient per part), else slices. KV heads
    may be shared by several ranks' parts, so k and v are always sliced (they are the smaller)."""
    tiles = heads[0].q_start == 0 and heads[-1].q_end == q.shape[1] and \
        all(part.q_end == after.q_start for part, after in zip(heads, heads[1:]))
    if tiles:
        return q.split([part.num_q for part in heads], dim=1)
    return [q[:, part.q_start:part.q_end] for part in heads]


def heads_to_seq(out, group, shard_sizes: Sequence[int], heads: Sequence[HeadSlice], rank_in_group: int):
    """Inverse exchange: out (T, h_me, D) for this rank's heads -> (n_me, H, D) for its shard."""
    head_dim, num_mine = out.shape[2], heads[rank_in_group].num_q
    send_splits = [n * num_mine * head_dim for n in shard_sizes]
    num_local = shard_sizes[rank_in_group]
    recv_splits = [num_local * p.num_q * head_dim for p in heads]
    recv = _AllToAllFlat.apply(out.reshape(-1), group, tuple(send_splits), tuple(recv_splits), None)
    pieces = [piece.view(num_local, p.num_q, head_dim) for piece, p in zip(recv.split(recv_splits), heads)]
    return torch.cat(pieces, dim=1)


# ---------------------------------------------------------------- DeepSpeed's primitives, where they fit
def deepspeed_exchange_ready() -> bool:
    """True if DeepSpeed's sequence all-to-all can run here (importable, deepspeed.comm initialized)."""
    try:
        import deepspeed.comm as ds_comm
        from deepspeed.sequence.layer import _SeqAllToAll  # noqa: F401
    except Exception:  # DeepSpeed absent or unusable on this machine: our exchange covers all cases
        return False
    return bool(ds_comm.is_initialized())


def deepspeed_admits(shard_sizes: Sequence[int], num_heads: int, num_kv_heads: int) -> bool:
    """DeepSpeed's even-split exchange fits this pack (equal shards, heads divisible by the degree)."""
    degree = len(shard_sizes)
    return len(set(shard_sizes)) == 1 and num_heads % degree == 0 and num_kv_heads % degree == 0


def deepspeed_seq_to_heads(tensor_LHD, group):
    """(n, H, D) shard -> (n*d, H/d, D) via DeepSpeed's `_SeqAllToAll` (seq-first layout, batch 1)."""
    from deepspeed.sequence.layer import _SeqAllToAll

    out = _SeqAllToAll.apply(group, tensor_LHD.unsqueeze(1), 2, 0, 1)
    return out.squeeze(1)


def deepspeed_heads_to_seq(tensor_LHD, group):
    """(T, H/d, D) -> (T/d, H, D) via DeepSpeed's `_SeqAllToAll`."""
    from deepspeed.sequence.layer import _SeqAllToAll

    out = _SeqAllToAll.apply(group, tensor_LHD.unsqueeze(1), 0, 2, 1)
    return out.squeeze(1)
