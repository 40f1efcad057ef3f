"""Session-wide gloo process pools (one per world size), shared by every test in tests/distributed."""

from __future__ import annotations

import pytest

from harness import DistPool


@pytest.fixture(scope="session")
def dist_pools():
    pools: dict[int, DistPool] = {}

    def get(world_size: int) -> DistPool:
        """The pool of `world_size` ranks; the 4-rank pool also initializes deepspeed.comm."""
        if world_size not in pools:
            pools[world_size] = DistPool(world_size, with_deepspeed=world_size == 4)
        pool = pools[world_size]
        if not pool.alive:
            pool.close()
            pool.start()
        return pool

    yield get
    for pool in pools.values():
        pool.close()
