"""The test pool's rendezvous: the pool hosts the store on a port it holds, and the ranks join it."""

from __future__ import annotations

import errno
import socket

import pytest

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def rank_sum_and_port():
    import os

    import torch
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return float(value.item()), int(os.environ["MASTER_PORT"])


def test_ranks_join_the_store_the_pool_holds(dist_pools):
    """The ranks formed their group (the all-reduce) while the pool held the port they used."""
    pool = dist_pools(2)
    results = pool.run(rank_sum_and_port)
    assert [total for total, _ in results] == [3.0, 3.0]
    assert {port for _, port in results} == {pool._store.port}
    with socket.socket() as sock, pytest.raises(OSError) as taken:
        sock.bind(("127.0.0.1", pool._store.port))
    assert taken.value.errno == errno.EADDRINUSE
