"""What trainer/memory_estimate.py `host_memory` assumes of torch's pinned-memory allocator, on the GPU
machine's torch: a pinned buffer holds its size rounded up to a power of two (DeepSpeed pins the
offloaded optimizer's fp32 gradient buffer, `offload_optimizer.pin_memory`, with `Tensor.pin_memory`).
Run there: source tests/gpu/gpu_env.sh; python3 -m pytest -q tests/gpu/test_pinned_rounding_gpu.py"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_a_pinned_buffer_holds_what_the_estimate_counts():
    from flexrl_ds.trainer.memory_estimate import MemoryInputs, host_memory

    params = 3 * 2**20 + 1  # 12 MiB + 4 B of fp32 gradients: rounded up, 16 MiB
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    buffer = torch.zeros(params, dtype=torch.float32).pin_memory()
    held = torch.cuda.host_memory_stats()["allocated_bytes.current"] - before
    inputs = MemoryInputs(params=params, hidden=8, layers=1, intermediate=8, kv_dim=8, largest_param=params,
                          device_bytes=2**30, optimizer_offload_ratio=0.5, optimizer_offload_pinned=True)
    assert held == host_memory(inputs)["gradient buffer"] == 16 * 2**20
    unpinned = host_memory(dataclasses.replace(inputs, optimizer_offload_pinned=False))["gradient buffer"]
    assert unpinned == buffer.numel() * buffer.element_size()
