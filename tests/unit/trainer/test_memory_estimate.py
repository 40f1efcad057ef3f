"""The device memory estimate (trainer/memory_estimate.py) against hand-computed cases, and the
pre-start check and `flexrl estimate-memory` on a tiny model (trainer/memory_check.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flexrl_ds.trainer.memory_estimate import (CONTEXT_BYTES, ENGINE_ASLEEP_BYTES, GIB, HOST_BASE_BYTES,
                                               MemoryInputs, activation_bytes, estimate_memory, host_memory, pinned_block,
                                               policy_states, states_kept_in_rollout, vision_activation_bytes)

SMALL = dict(params=1000, hidden=8, layers=2, intermediate=16, kv_dim=4, largest_param=100, device_bytes=10**6)


def test_policy_states_by_hand():
    # 1000 bf16 parameters over 2 ranks: 2 B each, fp32 gradients 4 B, master + moments 12 B
    assert policy_states(MemoryInputs(**SMALL, ranks=2)) == {
        "policy parameters": 1000, "policy gradients": 2000, "optimizer states": 6000}
    # half the optimizer in host memory: gradients and optimizer halve on the device; fp32 training: no master copy
    assert policy_states(MemoryInputs(**SMALL, ranks=2, optimizer_offload_ratio=0.5)) == {
        "policy parameters": 1000, "policy gradients": 1000, "optimizer states": 3000}
    assert policy_states(MemoryInputs(**SMALL, dtype_bytes=4, master_weights=False, param_offload=True)) == {
        "policy parameters": 0, "policy gradients": 4000, "optimizer states": 8000}


def test_what_stays_on_the_device_while_the_engine_generates():
    states = {"policy parameters": 1, "policy gradients": 2, "optimizer states": 3}
    assert states_kept_in_rollout(MemoryInputs(**SMALL, offload_states_in_rollout=False), states) == states
    assert states_kept_in_rollout(MemoryInputs(**SMALL, fused_adam=True), states) == {}
    assert states_kept_in_rollout(MemoryInputs(**SMALL), states) == {"optimizer states": 3, "policy gradients": 2}
    assert states_kept_in_rollout(MemoryInputs(**SMALL, optimizer_offload_ratio=0.5), states) == {
        "policy gradients": 2, "optimizer states": 3}


def test_host_memory_by_hand():
    # 60% of the optimizer offloaded, unpinned: a bf16 flat gradient buffer for all 1000 parameters (2 B
    # each) and fp32 gradients for the 600 offloaded (4 B), their master weights and moments (12 B)
    inputs = MemoryInputs(**SMALL, optimizer_offload_ratio=0.6, reference_offload=True, engine_sleep_level=1)
    assert host_memory(inputs) == {"base": HOST_BASE_BYTES, "gradient buffers": 2000 + 2400,
                                   "offloaded optimizer": 7200, "reference parameters": 3500,
                                   "states moved for the rollout": 2048, "engine weights asleep": 2000}
    assert host_memory(MemoryInputs(**SMALL, engine=None)) == {"base": HOST_BASE_BYTES}


def test_pinned_buffers_count_as_torchs_allocator_holds_them():
    assert [pinned_block(n) for n in (0, 1, 1000, 1024, 1025, 300 * 2**20)] == [0, 1, 1024, 1024, 2048, 512 * 2**20]
    # pinned: the flat buffer (2000 B) held as 2048; 600 offloaded in sub-groups of 250: 3 buffers of 1000 B as 1024
    inputs = MemoryInputs(**SMALL, optimizer_offload_ratio=0.6, optimizer_offload_pinned=True, sub_group_elements=250)
    assert host_memory(inputs)["gradient buffers"] == 2048 + 3 * 1024
    # FusedAdam moves every state in buffers of their own: not counted as one block
    fused = MemoryInputs(**SMALL, fused_adam=True)
    assert host_memory(fused)["states moved for the rollout"] == sum(policy_states(fused).values())


def test_the_config_reader_takes_the_offload_pinning():
    from flexrl_ds.trainer.memory_check import zero3_inputs

    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.6, "pin_memory": True}}
    assert zero3_inputs({"zero_optimization": zero})["optimizer_offload_pinned"] is True
    zero["offload_optimizer"]["pin_memory"] = False
    assert zero3_inputs({"zero_optimization": zero})["optimizer_offload_pinned"] is False
    assert zero3_inputs({"zero_optimization": {"stage": 3}})["optimizer_offload_pinned"] is False


def test_activations_by_hand():
    # per token and layer: 2 B x (12 x 8 hidden + 4 x 16 MLP + 4 x 4 KV) = 352 B
    inputs = MemoryInputs(**SMALL, update_tokens=10)
    assert activation_bytes(inputs) == 2 * 352 * 10
    # checkpointed: one hidden state per layer (2 x 8 x 2 B) and one layer's whole set
    assert activation_bytes(dataclasses.replace(inputs, checkpointing=True)) == (2 * 8 * 2 + 352) * 10


def test_vision_activations_against_the_towers_saved_tensors(tiny_model):
    """The estimate's vision term against what autograd actually saves for backward in transformers'
    vision tower (tiny Qwen2.5-VL, fp32, no checkpointing): 48 images of 8 x 8 patches, each its own
    attention span, so that the per-span attention matrices stay small beside the per-row terms."""
    import torch
    import transformers

    from flexrl_ds.trainer.memory_check import model_size

    model = transformers.AutoModelForImageTextToText.from_config(transformers.AutoConfig.from_pretrained(tiny_model))
    visual = model.model.visual
    vision = model.config.vision_config
    grids = torch.tensor([[1, 8, 8]] * 48)
    rows = int(grids.prod(dim=1).sum())
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    pixels = torch.randn(rows, patch_dim, requires_grad=True)
    weights = {p.data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def keep(tensor):
        if tensor.data_ptr() not in weights:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        visual(pixels, grid_thw=grids)
    size = {k: v for k, v in model_size(tiny_model).items() if k.startswith("vision")}
    estimate = vision_activation_bytes(MemoryInputs(**SMALL, **size, dtype_bytes=4,
                                                    update_vision_tokens=rows // size["vision_merge"] ** 2))
    measured = sum(saved.values())
    assert 0.7 * measured <= estimate <= 1.4 * measured, (estimate, measured)


def test_phases_by_hand():
    inputs = MemoryInputs(**dict(SMALL, device_bytes=100 * GIB), gpu_memory_utilization=0.25, update_tokens=10,
                          logprob_tokens=20, logprob_chunk_bytes=500, reduce_bucket_elements=50,
                          prefetch_elements=10, reuse_elements=20, sub_group_elements=10**9, sync_bucket_bytes=300)
    estimate = estimate_memory(inputs)
    states = 2000 + 4000 + 12000  # one rank: parameters, fp32 gradients, master weights and moments
    reference, gathered = 2000, (100 + 10 + 20) * 2
    assert estimate.total("rollout") == 4000 + 12000 + reference + 25 * GIB + CONTEXT_BYTES
    assert estimate.total("logprobs") == (states + reference + ENGINE_ASLEEP_BYTES + gathered + 500
                                          + 2 * (6 * 8 + 3 * 16) * 20 + CONTEXT_BYTES)
    step_grads = 1000 * 4  # the optimizer step's fp32 gradients of the (one) sub-group
    assert estimate.total("update") == (states + reference + ENGINE_ASLEEP_BYTES + gathered + 50 * 2
                                        + max(2 * 352 * 10 + 500, step_grads) + CONTEXT_BYTES)
    assert estimate.total("sync") == states + reference + 2000 + 300 + gathered + CONTEXT_BYTES
    assert estimate.fits() and not estimate.refused()
    separate = estimate_memory(dataclasses.replace(inputs, engine=None))
    assert set(separate.phases) == {"logprobs", "update"}


def test_persistent_parameters_by_hand():
    # 100 persistent elements in bf16 (200 B): one rank holds them whole in its partition already
    inputs = MemoryInputs(**SMALL, persistent_elements=100, reference=False)
    assert "zero3 persistent" in estimate_memory(inputs).phases["update"]
    assert estimate_memory(inputs).phases["update"]["zero3 persistent"] == 0
    # 4 ranks: each holds the whole (200 B) beside its quarter (50 B) already counted
    four = dataclasses.replace(inputs, ranks=4)
    assert estimate_memory(four).phases["update"]["zero3 persistent"] == 150
    # parameters offloaded: the persistent ones stay on the device, whole and their partition
    assert estimate_memory(dataclasses.replace(four, param_offload=True)).phases["logprobs"]["zero3 persistent"] == 250
    assert estimate_memory(dataclasses.replace(inputs, param_offload=True)).phases["sync"]["zero3 persistent"] == 200
    # the reference engine reads the same JSON; offloaded, its persistent parameters stay on the device too
    both = dataclasses.replace(inputs, reference=True, reference_offload=True)
    assert estimate_memory(both).phases["update"]["zero3 persistent"] == 200
    assert "zero3 persistent" not in estimate_memory(dataclasses.replace(inputs, persistent_elements=0)).phases["update"]


def test_model_size_counts_persistent_parameters_by_threshold(tiny_model):
    from flexrl_ds.models.loading import model_without_weights
    from flexrl_ds.trainer.memory_check import model_size

    model = model_without_weights(tiny_model)
    sizes = [p.numel() for p in model.parameters()]
    assert model_size(tiny_model)["persistent_elements"] == 0
    assert model_size(tiny_model, 10**15)["persistent_elements"] == sum(sizes)
    assert model_size(tiny_model, 100)["persistent_elements"] == sum(n for n in sizes if n <= 100)
    # the model-wide cap: parameters in module order while the sum stays within it
    total = 0
    for numel in sizes:
        if numel <= 100 and total + numel <= 500:
            total += numel
    capped = model_size(tiny_model, 100, 500)["persistent_elements"]
    assert capped == total <= 500


def qwen_like(**changes) -> MemoryInputs:
    """A 3B-like model on an 80 GB card (the issue's H100 case)."""
    base = dict(params=3_960_000_000, hidden=2048, layers=36, intermediate=11008, kv_dim=256,
                largest_param=311_000_000, device_bytes=int(79.6 * GIB), gpu_memory_utilization=0.3,
                offload_states_in_rollout=False, update_tokens=52_000, logprob_tokens=52_000,
                reuse_elements=200_000_000)
    return MemoryInputs(**{**base, **changes})


def test_a_run_over_the_device_is_refused_and_the_advice_makes_it_fit():
    estimate = estimate_memory(qwen_like())
    assert estimate.refused() and {"rollout", "update"} <= set(estimate.over())
    rollout = estimate.advice("rollout")  # torch's AdamW: the move takes the parameters (7.4 GiB) off
    assert any(line.startswith("flexrl.trainer.offload_states_in_rollout: true (saves ~7.4 GiB)") for line in rollout)
    fused = estimate_memory(qwen_like(fused_adam=True)).advice("rollout")  # FusedAdam: every state moves
    assert fused[0].startswith("flexrl.trainer.offload_states_in_rollout: true (saves ~66.4 GiB)")
    update = estimate.advice("update")
    assert any(line.startswith("flexrl.trainer.activation_checkpointing: true") for line in update)
    # the states alone fill the device: no token cap can make it fit, so none is offered
    assert not any(line.startswith("flexrl.sp.max_tokens_per_rank") for line in update)
    offloaded = estimate_memory(qwen_like(optimizer_offload_ratio=0.3))
    cap = next(line for line in offloaded.advice("update") if line.startswith("flexrl.sp.max_tokens_per_rank"))
    tokens = int(cap.split(": ")[1].split(" ")[0])
    # the suggested cap alone takes the activations under what the update's other terms leave
    capped = estimate_memory(qwen_like(optimizer_offload_ratio=0.3, update_tokens=tokens))
    assert capped.total("update") <= capped.device_bytes < estimate_memory(
        qwen_like(optimizer_offload_ratio=0.3, update_tokens=tokens + 512)).total("update")
    fixed = estimate_memory(qwen_like(offload_states_in_rollout=True, checkpointing=True, update_tokens=16384,
                                      optimizer_offload_ratio=0.3))
    assert fixed.fits(), fixed.format()


def test_within_the_uncertainty_is_not_refused():
    inputs = qwen_like(engine=None, checkpointing=True, update_tokens=16384, optimizer_offload_ratio=0.3)
    total = max(estimate_memory(inputs).total(p) for p in ("update", "logprobs"))  # not the device's share
    near = estimate_memory(dataclasses.replace(inputs, device_bytes=int(total / 1.02)))
    assert not near.fits() and not near.refused() and "may fit" in near.format()
    far = estimate_memory(dataclasses.replace(inputs, device_bytes=int(total / 1.05)))
    assert far.refused()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    return str(make_tiny_model(TinyModelConfig(out_dir=str(tmp_path_factory.mktemp("mem") / "vl")), weights=False))


def run_config(tmp_path, **trainer):
    from flexrl_ds.config.flexrl_config import load_run_config

    raw = json.loads(open("ds_configs/grpo_tiny_cpu.json").read())
    raw["flexrl"]["trainer"].update(trainer)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return load_run_config(path), path


def test_pre_start_check_refuses_warns_or_skips(tmp_path, tiny_model, capsys):
    from flexrl_ds.trainer.memory_check import check_memory

    run, _ = run_config(tmp_path, device_memory_gb=0.01)
    with pytest.raises(ValueError, match=r"device memory: the \w+ phase needs .* Change .*flexrl\.") as error:
        check_memory(run, tiny_model, 4)
    assert "\n" not in str(error.value)
    run, _ = run_config(tmp_path, device_memory_gb=0.01, memory_check="warn")
    assert not check_memory(run, tiny_model, 4).fits()
    assert capsys.readouterr().out.startswith("warning: device memory:")
    run, _ = run_config(tmp_path, device_memory_gb=0.01, memory_check="off")
    assert check_memory(run, tiny_model, 4) is None
    run, _ = run_config(tmp_path, device_memory_gb=80)
    assert check_memory(run, tiny_model, 4).fits()


def test_a_launcher_started_run_counts_the_engine_in_its_ranks(tmp_path, tiny_model):
    """Under --spmd the engines always run inside the policy ranks (colocate false is ignored there),
    so the estimate counts them; a Ray run with separate engines does not."""
    from flexrl_ds.trainer.memory_check import memory_inputs

    run, _ = run_config(tmp_path, colocate=False)
    assert memory_inputs(run, tiny_model, 4, 80 * 2**30).engine is None
    assert memory_inputs(run, tiny_model, 4, 80 * 2**30, spmd=True).engine == run.flexrl.rollout.backend


def test_pre_start_check_refuses_a_run_past_the_host_kill_line(tmp_path, tiny_model, capsys, monkeypatch):
    """On the GPU's own node (no device_memory_gb), a host-memory estimate past Ray's kill share by more
    than the estimate's uncertainty is refused like a device overflow; "warn" starts it with the line."""
    from flexrl_ds.trainer import memory_check

    monkeypatch.setattr(memory_check.device_mod, "device_memory_bytes", lambda: 80 * 2**30)
    monkeypatch.setattr(memory_check.device_mod, "num_gpus", lambda: 1)
    monkeypatch.setattr(memory_check.node_memory, "bytes_total", lambda: 2**20)  # a 1 MiB host
    run, _ = run_config(tmp_path)
    with pytest.raises(ValueError, match=r"host memory: .* over Ray's kill line .*offload") as error:
        memory_check.check_memory(run, tiny_model, 1)
    assert "\n" not in str(error.value)
    run, _ = run_config(tmp_path, memory_check="warn")
    assert memory_check.check_memory(run, tiny_model, 1).fits()
    assert capsys.readouterr().out.startswith("warning: host memory:")
    monkeypatch.setattr(memory_check.node_memory, "bytes_total", lambda: 2**40)  # a 1 TiB host
    run, _ = run_config(tmp_path)
    assert memory_check.check_memory(run, tiny_model, 1).fits()
    assert "host memory" not in capsys.readouterr().out


def test_estimate_memory_command(tmp_path, tiny_model, capsys):
    from flexrl_ds.cli.main import main

    _, path = run_config(tmp_path)
    assert main(["estimate-memory", "--config", str(path), "--model", tiny_model, "--device-memory-gb", "80"]) == 0
    out = capsys.readouterr().out
    assert "update" in out and "fits" in out
    assert main(["estimate-memory", "--config", str(path), "--model", tiny_model, "--device-memory-gb", "0.01",
                 "--prompt-tokens", "100"]) == 1
    assert "over in" in capsys.readouterr().out


@pytest.mark.parametrize("ranks,sub_group", [(1, 250), (2, 250), (1, 10**6), (1, 2113), (4, 70), (1, 400)])
def test_offloaded_sub_groups_are_deepspeeds(ranks, sub_group):
    """The estimate's sub-groups against DeepSpeed 0.19's own grouping (`_create_fp16_sub_groups`, on
    stand-in parameters of the same partition sizes) and its rule for which go to the host."""
    from types import SimpleNamespace

    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    from flexrl_ds.trainer.memory_estimate import offloaded_sub_groups

    sizes = (100, 7, 300, 64, 64, 900, 5, 120, 120, 33, 400)  # 2113 in all; the last closes a group of 400
    # a partition holds ceil(numel / ranks) elements (DeepSpeed's ds_numel: the size aligned to the ranks)
    params = [SimpleNamespace(partition_numel=lambda n=n: -(-n // ranks)) for n in sizes]
    groups = DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(SimpleNamespace(sub_group_size=sub_group), params)
    elements = [sum(p.partition_numel() for p in group) for group in groups]
    for ratio in (0.3, 0.6, 1.0):
        on_host = [e for index, e in enumerate(elements) if index >= int((1 - ratio) * len(elements))]
        assert offloaded_sub_groups(sizes, ranks, sub_group, ratio) == on_host


def test_pinned_gradient_buffers_follow_the_sub_groups():
    # sizes 600 and 400 in sub-groups of >= 500: [600, 400]; at ratio 0.5 the second (400 fp32 = 1600 B) on the host
    inputs = MemoryInputs(**{**SMALL, "params": 1000}, param_sizes=(600, 400), optimizer_offload_ratio=0.5,
                          optimizer_offload_pinned=True, sub_group_elements=500)
    assert host_memory(inputs)["gradient buffers"] == pinned_block(2000) + pinned_block(1600)
