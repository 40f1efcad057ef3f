"""FlexUlysses on GPUs with the GPU backend: the tests/distributed equivalence checks, plus bf16 varlen kernels.

Runs on a machine with >= 2 GPUs (skipped elsewhere). Ranks come from the same process-pool harness as
tests/distributed (tests/distributed/harness.py), one GPU each.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from harness import gpu_pool  # noqa: E402
from plans import check_against_reference, rank_run_plans  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.dist, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def two_gpu_pool():
    try:
        import deepspeed  # noqa: F401
        with_deepspeed = True
    except Exception:
        with_deepspeed = False
    with gpu_pool(2, with_deepspeed=with_deepspeed) as pool:
        yield pool


@pytest.mark.parametrize("overlap", [True, False])
def test_two_gpus_fp64_mixed_degrees(two_gpu_pool, overlap):
    seeds = list(range(8))
    args = dict(domain_size=2, p_max=2, num_heads=28, num_kv_heads=4, head_dim=16, dtype="float64", max_len=64)
    per_rank = two_gpu_pool.run(rank_run_plans, seeds, overlap=overlap, **args)
    worst = check_against_reference(per_rank, seeds, world_size=2, **args)
    print(f"fp64 overlap={overlap}: worst relative error {worst:.3g}")


def test_two_gpus_fp32(two_gpu_pool):
    seeds = list(range(4))
    args = dict(domain_size=2, p_max=2, num_heads=8, num_kv_heads=2, head_dim=32, dtype="float32", max_len=128)
    per_rank = two_gpu_pool.run(rank_run_plans, seeds, overlap=True, backend="sdpa", **args)
    check_against_reference(per_rank, seeds, world_size=2, **args)


def test_two_gpus_bf16_varlen_kernel(two_gpu_pool):
    """bf16 with the auto backend (torch varlen / flash-attn on GPU) against a float64 reference."""
    seeds = list(range(4))
    args = dict(domain_size=2, p_max=2, num_heads=28, num_kv_heads=4, head_dim=128, dtype="bfloat16",
                max_len=256)
    per_rank = two_gpu_pool.run(rank_run_plans, seeds, overlap=True, backend="auto", **args)
    worst = check_against_reference(per_rank, seeds, world_size=2, **args)
    print(f"bf16 local attention {per_rank[0][0]['local_attention']}: worst relative error {worst:.3g}")


def test_two_gpus_fixed_sp_baseline(two_gpu_pool):
    seeds = [31, 32]
    args = dict(domain_size=2, p_max=2, num_heads=8, num_kv_heads=2, head_dim=16, dtype="float64", fixed=True)
    per_rank = two_gpu_pool.run(rank_run_plans, seeds, overlap=False, **args)
    check_against_reference(per_rank, seeds, world_size=2, **args)
    print(f"fixed SP exchange: {per_rank[0][0]['paths']}")
