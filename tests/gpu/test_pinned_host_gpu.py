"""parallel/device.py `pinned_host_bytes` on a GPU: a pinned host tensor is counted at least at its
size, now and in the peak, and the peak outlives the tensor until `reset_peak_memory` (what the
trainer reports per phase as `peak_pinned_host_gb`). It also prints how torch sized the block: torch
2.11 on an H100 held 512 MiB for 300 MiB (2026-12-06), the rounding trainer/memory_estimate.py counts.
Run there: source tests/gpu/gpu_env.sh; python3 -m pytest -q -s tests/gpu/test_pinned_host_gpu.py"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


def test_pinned_bytes_count_a_pinned_tensor():
    from flexrl_ds.parallel.device import detect, pinned_host_bytes, reset_peak_memory

    info = detect()
    torch.zeros(1, device="cuda")  # torch reports no pinned statistics before CUDA is initialised
    before = pinned_host_bytes(info)
    asked = 300 * 2**20
    block = torch.empty(asked, dtype=torch.uint8, pin_memory=True)
    held = pinned_host_bytes(info)
    print(f"torch {torch.__version__}: {asked / 2**20:.0f} MiB pinned, the allocator holds "
          f"{(held['current'] - before['current']) / 2**20:.0f} MiB more")
    assert held["current"] >= before["current"] + asked
    assert held["peak"] >= held["current"]
    del block
    assert pinned_host_bytes(info)["peak"] >= held["current"]  # a cached block stays counted
    reset_peak_memory(info)
    assert pinned_host_bytes(info)["peak"] <= held["current"]
