"""parallel/device.py `allocator_counts` on a GPU: a new block after the cache was emptied is one
more device malloc, and an allocation that only fits once the cache is freed is one more retry
(what the trainer reports per phase as `device_mallocs` and `alloc_retries`).
Run there: source tests/gpu/gpu_env.sh; python3 -m pytest -q tests/gpu/test_allocator_counts_gpu.py"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_mallocs_and_retries_are_counted():
    from flexrl_ds.parallel.device import allocator_counts, detect

    info = detect()
    torch.cuda.empty_cache()
    before = allocator_counts(info)
    block = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    after = allocator_counts(info)
    assert after["device_mallocs"] >= before["device_mallocs"] + 1
    del block
    free, _ = torch.cuda.mem_get_info()
    cached = torch.empty(int(free * 0.6), dtype=torch.uint8, device="cuda")  # most of the free memory...
    del cached  # ...now cached by torch, not free on the device
    bigger = torch.empty(int(free * 0.7), dtype=torch.uint8, device="cuda")  # fits only after freeing the cache
    assert allocator_counts(info)["alloc_retries"] >= after["alloc_retries"] + 1
    del bigger
    torch.cuda.empty_cache()
