"""The ZeRO-3 settings that cut hook work (docs/notes/zero3-one-rank-host-cost.md) change nothing computed.

Every parameter persistent (`stage3_param_persistence_threshold` above any parameter; or only those of
at most 100 elements, the tiny model's norms and biases), every decoder
layer and vision block a ZeRO-3 leaf (`build_engine(leaf_layers=True)`, `flexrl.trainer.zero3_leaf_layers`),
both, and both with the optimizer or the parameters offloaded: a tiny Qwen2.5-VL (and the Qwen3-VL
MoE, whose sparse blocks are leaves already) under FlexUlysses on 4 gloo ranks with activation
checkpointing gives the single-process HF model's loss and every parameter's full gradient, and
after an optimizer step the same loss as the shipped settings' engine (every parameter gathered at
each use, no leaves) after its step. The
elements DeepSpeed marks persistent are those the memory estimate counts (trainer/memory_check.py).
"""

from __future__ import annotations

import pytest
import torch

from grad_checks import worst_relative_grad_diff
from harness import cached_group_tree

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

EVERY_PARAMETER = 10**15
"""A persistence threshold above any parameter's elements."""


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from flexrl_ds.models.sample_data import write_scoring_dataset
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("zero3_settings")
    make_tiny_model(TinyModelConfig(out_dir=str(root / "vl"), seed=5, num_hidden_layers=3, vision_depth=3))
    make_tiny_model(TinyModelConfig(out_dir=str(root / "q3moe"), arch="qwen3-vl-moe", seed=5))
    return root, write_scoring_dataset(root / "data", num_records=5, seed=2)


def _ds_config(persistence: int, offload: str, granularity: int = 0) -> dict:
    from zero3_configs import zero3_config

    from flexrl_ds.models.zero3 import with_param_offload

    config = zero3_config(offload_optimizer="torch_adam" if offload == "optimizer" else "none")
    config["zero_optimization"]["stage3_param_persistence_threshold"] = persistence
    if granularity:
        config["zero_optimization"]["stage3_module_granularity_threshold"] = granularity
    return with_param_offload(config) if offload == "param" else config


def rank_step(model_dir: str, data_path: str, plan_json: dict, p_max: int, persistence: int, leaf_layers: bool,
              offload: str, granularity: int = 0):
    """On every rank: the engine with the settings, one forward+backward under activation
    checkpointing (rank 0 returns the full gradients), an optimizer step, and the loss again
    without grad (persistent or leaf parameters must carry the step's update)."""
    import torch.distributed as dist

    from flexrl_ds.models.flex_model import build_step_batch, positions_fn
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.models.processing import encode_records
    from flexrl_ds.models.zero3 import build_engine, flex_step_loss, full_grads
    from flexrl_ds.planning.plan import parse_plan

    torch.manual_seed(0)
    tree = cached_group_tree(dist.get_world_size(), p_max)
    model = load_model(model_dir)
    batch = build_step_batch(model.config, parse_plan(plan_json), encode_records(model_dir, data_path),
                             tree.local_rank, tree, positions=positions_fn(model))
    engine = build_engine(model, _ds_config(persistence, offload, granularity), activation_checkpointing=True,
                          leaf_layers=leaf_layers)
    loss, local_nll, _ = flex_step_loss(engine, batch)
    engine.backward(loss)
    grads = full_grads(engine)
    engine.step()
    with torch.no_grad():
        _, stepped_nll, _ = flex_step_loss(engine, batch)
    leaves = sum(1 for module in engine.module.modules() if getattr(module, "_z3_leaf", False))
    persistent = [p.ds_numel for p in engine.module.parameters() if p.ds_persist]
    engine.destroy()
    return {"nll": float(local_nll), "stepped_nll": float(stepped_nll), "grads": grads if dist.get_rank() == 0 else None, "leaves": leaves,
            "persistent": persistent}


def _reference(model_dir: str, data_path: str):
    """The plain HF model, one sample at a time: summed NLL and the mean NLL's gradients."""
    from flexrl_ds.models.flex_model import reference_logprobs
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.models.processing import encode_records

    samples = encode_records(model_dir, data_path)
    model = load_model(model_dir)
    logprobs = [reference_logprobs(model, sample) for sample in samples.values()]
    nll = -sum(values.sum() for values in logprobs)
    (nll / sum(values.numel() for values in logprobs)).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return float(nll.detach()), grads, {name: sample.length for name, sample in samples.items()}


def test_a_granularity_threshold_beside_the_moe_leaves(assets, dist_pools):
    """`stage3_module_granularity_threshold` 1 (no module that fine: it picks no leaf of its own, but
    turns on DeepSpeed's faster leaf release) with the MoE's sparse blocks as leaves: the
    single-process loss and gradients still."""
    from flexrl_ds.models.sample_data import random_plan_for

    root, data = assets
    model_dir = str(root / "q3moe")
    ref_nll, ref_grads, lengths = _reference(model_dir, str(data))
    plan = random_plan_for(lengths, 4, p_max=4, seed=1)
    per_rank = dist_pools(4).run(rank_step, model_dir, str(data), plan.to_json(), plan.p_max, 0, False, "none", 1,
                                 timeout_s=240)
    assert all(r["leaves"] >= 1 for r in per_rank)
    assert sum(r["nll"] for r in per_rank) == pytest.approx(ref_nll, rel=1e-5)
    grads = per_rank[0]["grads"]
    worst = max(((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp(min=1e-6)).item()
                for n in ref_grads)
    assert worst < 1e-4, worst


@pytest.mark.parametrize("arch,persistence,leaf_layers,offload", [
    ("vl", EVERY_PARAMETER, False, "none"), ("vl", 100, False, "none"), ("vl", 0, True, "none"), ("vl", EVERY_PARAMETER, True, "none"),
    ("vl", EVERY_PARAMETER, True, "optimizer"), ("vl", 0, True, "param"), ("q3moe", 0, True, "none")])
def test_settings_match_single_process(assets, dist_pools, arch, persistence, leaf_layers, offload):
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.models.sample_data import random_plan_for
    from flexrl_ds.models.zero3 import layer_classes
    from flexrl_ds.trainer.memory_check import model_size

    root, data = assets
    model_dir = str(root / arch)
    ref_nll, ref_grads, lengths = _reference(model_dir, str(data))
    plan = random_plan_for(lengths, 4, p_max=4, seed=1)
    per_rank = dist_pools(4).run(rank_step, model_dir, str(data), plan.to_json(), plan.p_max, persistence,
                                 leaf_layers, offload, timeout_s=240)
    model = load_model(model_dir)
    layers = sum(isinstance(module, tuple(layer_classes(model))) for module in model.modules())
    assert layers >= 4
    if leaf_layers:  # each layer, and the MoE's sparse blocks inside them
        assert all(r["leaves"] >= layers for r in per_rank), [r["leaves"] for r in per_rank]
    # DeepSpeed's own marking, against the memory estimate's count (trainer/memory_check.py)
    expected = model_size(model_dir, persistence)["persistent_elements"]
    assert all(sum(r["persistent"]) == expected for r in per_rank)
    if persistence == EVERY_PARAMETER:
        assert all(len(r["persistent"]) == len(list(model.parameters())) for r in per_rank)
    elif persistence:
        assert all(0 < len(r["persistent"]) < len(list(model.parameters())) for r in per_rank)
    assert sum(r["nll"] for r in per_rank) == pytest.approx(ref_nll, rel=1e-5)
    worst = worst_relative_grad_diff(per_rank[0]["grads"], ref_grads)
    assert worst < 1e-4, worst
    shipped = dist_pools(4).run(rank_step, model_dir, str(data), plan.to_json(), plan.p_max, 0, False, "none",
                                timeout_s=240)
    stepped = sum(r["stepped_nll"] for r in per_rank)
    assert stepped != pytest.approx(ref_nll, rel=1e-6)  # the step changed the weights
    assert stepped == pytest.approx(sum(r["stepped_nll"] for r in shipped), rel=1e-5)
