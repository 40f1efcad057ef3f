"""Tiny Qwen2.5-VL / Qwen3-VL (dense, MoE) / Qwen2 under DeepSpeed ZeRO-3 + FlexUlysses on 4 and 8 gloo ranks equals plain HF.

Reference: the single-process HF model (its own positions, its own vision tower calls, sdpa
attention), mean NLL of all response tokens. Checked: the summed loss over ranks and every
parameter's full gradient (read back with deepspeed.utils.safe_get_full_grad).
"""

from __future__ import annotations

import json

import pytest
import torch

from grad_checks import worst_relative_grad_diff
from harness import cached_group_tree

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from flexrl_ds.models.sample_data import text_only_copy, write_scoring_dataset
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("zero3")
    make_tiny_model(TinyModelConfig(out_dir=str(root / "vl"), seed=5))
    make_tiny_model(TinyModelConfig(out_dir=str(root / "q2"), arch="qwen2", seed=5))
    make_tiny_model(TinyModelConfig(out_dir=str(root / "q3"), arch="qwen3-vl", seed=5))
    make_tiny_model(TinyModelConfig(out_dir=str(root / "q3moe"), arch="qwen3-vl-moe", seed=5))
    data = write_scoring_dataset(root / "data", num_records=7, seed=2)
    # 2 images for 4 ranks: two ranks have no vision unit and must run the tower on a dummy input
    few = write_scoring_dataset(root / "few", num_records=3, seed=3, with_video=False)
    # the text model scores the same records without their media (written once, before any rank reads)
    return root, {"many": data, "few": few, "many-text": text_only_copy(data)}


def _load(model_dir: str):
    import transformers

    from flexrl_ds.models.hf_adapter import is_vision_language

    config = transformers.AutoConfig.from_pretrained(model_dir)
    cls = transformers.AutoModelForImageTextToText if hasattr(config, "vision_config") \
        else transformers.AutoModelForCausalLM
    model = cls.from_pretrained(model_dir, dtype=torch.float32)
    assert is_vision_language(model) == hasattr(config, "vision_config")
    return model


def _samples(model_dir: str, data_path: str, shared: bool = False):
    """Encoded records (every rank reads the same files; nothing is written here). shared: every
    record twice, as two GRPO samples whose media carry a share key (encoded once per step)."""
    import dataclasses

    from flexrl_ds.models.processing import encode_records

    samples = encode_records(model_dir, data_path)
    if not shared:
        return samples
    out = {}
    for seq_id, sample in samples.items():
        items = [dataclasses.replace(item, share_key=f"{seq_id}/{k}") for k, item in enumerate(sample.items)]
        for copy in ("a", "b"):
            out[f"{seq_id}-{copy}"] = dataclasses.replace(sample, id=f"{seq_id}-{copy}", items=items)
    return out


def rank_zero3_step(model_dir: str, data_path: str, plan_json: dict, p_max: int, shared: bool = False):
    """On every rank: ZeRO-3 engine, one FlexUlysses forward+backward; rank 0 returns grads."""
    import torch.distributed as dist

    from zero3_configs import zero3_config

    from flexrl_ds.models.flex_model import build_step_batch, positions_fn
    from flexrl_ds.models.zero3 import build_engine, flex_step_loss, full_grads
    from flexrl_ds.planning.plan import parse_plan

    torch.manual_seed(0)
    tree = cached_group_tree(dist.get_world_size(), p_max)
    samples = _samples(model_dir, data_path, shared)
    model = _load(model_dir)
    plan = parse_plan(plan_json)
    batch = build_step_batch(model.config, plan, samples, tree.local_rank, tree, positions=positions_fn(model))
    # small reduce buckets: many reduce-scatters, so a rank-dependent gradient order would show; a
    # misspelt key rides along: DeepSpeed never reads it, and the engine names it
    engine = build_engine(model, {**zero3_config(reduce_bucket_size=4096), "gradient_clippping": 1e-9})
    loss, local_nll, num_global = flex_step_loss(engine, batch)
    engine.backward(loss)
    grads = full_grads(engine)
    patches = batch.route.patches_per_rank if batch.route is not None else ()
    result = {"nll": float(local_nll), "num_global": num_global, "patches": list(patches),
              "paths": list(engine.module.attention.last_paths), "unread": engine.module.unread_config_keys}
    if dist.get_rank() == 0:
        result["grads"] = grads
    engine.destroy()
    return result


def _reference(model_dir: str, data_path: str, shared: bool = False):
    from flexrl_ds.models.flex_model import reference_logprobs

    samples = _samples(model_dir, data_path, shared)
    model = _load(model_dir)
    total_nll, total_tokens = 0.0, 0
    nll = 0.0
    for sample in samples.values():
        logprobs = reference_logprobs(model, sample)
        nll = nll - logprobs.sum()
        total_tokens += logprobs.numel()
    loss = nll / total_tokens
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    total_nll = float(nll.detach())
    return total_nll, total_tokens, grads, {s: x.length for s, x in samples.items()}


def _all_on_rank_zero(lengths, world):
    """Every sequence in one degree-1 pack on rank 0: ranks 1.. hold no token (idle forward)."""
    from flexrl_ds.planning.plan import Pack, Plan

    return Plan(world_size=world, p_max=world, packs=(Pack(0, 1, (0,), tuple(lengths)),),
                rank_order={r: ((0,) if r == 0 else ()) for r in range(world)})


@pytest.mark.parametrize("arch,seed,dataset,world", [("vl", 0, "many", 4), ("q2", 1, "many", 4), ("vl", 2, "few", 4),
                                                     ("vl", 3, "many", 8), ("vl", -1, "few", 4),
                                                     ("vl", 4, "few-shared", 4), ("q3", 0, "many", 4),
                                                     ("q3", 4, "many-shared", 4), ("q3moe", 0, "many", 4)])
def test_zero3_flex_ulysses_matches_single_process(assets, dist_pools, arch, seed, dataset, world):
    """seed -1: the idle-rank plan (all tokens on rank 0; vision units still spread over 4 ranks)."""
    from flexrl_ds.models.sample_data import random_plan_for

    root, datasets = assets
    shared = dataset.endswith("-shared")
    data = datasets[dataset.removesuffix("-shared") + ("-text" if arch == "q2" else "")]
    model_dir = str(root / arch)
    ref_nll, ref_tokens, ref_grads, lengths = _reference(model_dir, str(data), shared)
    plan = random_plan_for(lengths, world, p_max=min(world, 8), seed=seed) if seed >= 0 \
        else _all_on_rank_zero(lengths, world)
    per_rank = dist_pools(world).run(rank_zero3_step, model_dir, str(data), plan.to_json(), plan.p_max, shared,
                                     timeout_s=240)
    assert all(r["num_global"] == ref_tokens for r in per_rank)
    assert all(r["unread"] == ("gradient_clippping",) for r in per_rank)  # every other key was read
    assert sum(r["nll"] for r in per_rank) == pytest.approx(ref_nll, rel=1e-5)
    paths = {p for r in per_rank for p in r["paths"]}
    assert seed < 0 or paths & {"flex", "flex-async", "deepspeed"}, json.dumps([r["paths"] for r in per_rank])
    assert dataset == "few" or "local" in paths, json.dumps([r["paths"] for r in per_rank])
    worst = worst_relative_grad_diff(per_rank[0]["grads"], ref_grads)
    assert worst < 1e-4, worst
    if arch != "q2":
        patches = per_rank[0]["patches"]
        if dataset.startswith("many"):
            assert sum(p > 0 for p in patches) >= min(world, 4), patches
        elif shared:  # 2 images, each encoded once for its two samples
            assert sorted(p > 0 for p in patches) == [False, False, True, True], patches
        else:
            assert sorted(p > 0 for p in patches) == [False, False, True, True], patches
