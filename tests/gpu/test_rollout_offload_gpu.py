"""The policy's ZeRO-3 states around a colocated rollout, on one GPU (zero3.RolloutOffload): under
torch's AdamW (`torch_adam`, the 3B file's optimizer) DeepSpeed refuses the fp32 states, and the
parameters, their gradients and the buckets move instead. Checked on the device, where the CPU test
(tests/distributed/test_grpo_update.py) cannot see it: the moved states leave the GPU's allocations,
come back onto it, and the next step equals that of an engine whose states never moved.
Run there: `source tests/gpu/gpu_env.sh && python3 -m pytest -q tests/gpu/test_rollout_offload_gpu.py` (DeepSpeed
from .whl/)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

from harness import gpu_pool  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.dist, pytest.mark.timeout(300)]

WIDTH, LAYERS = 1024, 8


@pytest.fixture(scope="module")
def one_gpu_pool():
    with gpu_pool(1) as pool:
        yield pool


def rank_two_steps(move_states: bool) -> dict:
    """A bf16 ZeRO-3 engine of LAYERS linear layers under torch's AdamW; two steps, with the states
    moved to host memory and back between them when `move_states`."""
    import deepspeed

    from flexrl_ds.models.zero3 import RolloutOffload

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    inputs = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(1)).to(engine.device, torch.bfloat16)

    def step():
        loss = engine(inputs).float().square().mean()
        engine.backward(loss)
        engine.step()

    step()
    out: dict = {"numel": sum(p.ds_numel for p in engine.module.parameters())}
    if move_states:
        mover = RolloutOffload(engine)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out["moved"] = mover.offload()
        out["refusal"] = mover.refusal
        out["freed"] = before - torch.cuda.memory_allocated()
        mover.reload()
        out["back_on_device"] = all(p.ds_tensor.is_cuda for p in engine.module.parameters()) and \
            engine.optimizer.grad_partitions_flat_buffer.is_cuda
    step()
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        out["params"] = [p.detach().float().cpu().clone() for p in params]
    engine.destroy()
    return out


def test_states_leave_the_gpu_for_a_rollout_and_train_as_if_they_had_stayed(one_gpu_pool):
    kept = one_gpu_pool.run(rank_two_steps, False, timeout_s=240)[0]
    moved = one_gpu_pool.run(rank_two_steps, True, timeout_s=240)[0]
    assert set(moved["moved"]) == {"lp_params", "lp_grads", "contiguous_grad_buffer"}
    assert "FusedAdam" in moved["refusal"]
    assert moved["freed"] >= 2 * 2 * moved["numel"]  # at least the bf16 parameters and their gradients
    assert moved["back_on_device"]
    for ours, reference in zip(moved["params"], kept["params"], strict=True):
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
