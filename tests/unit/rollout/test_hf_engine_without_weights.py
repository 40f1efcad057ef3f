"""An hf engine started without reading its weights (`load_weights_at_start=False`, what the trainer
asks of colocated engines at sleep_level 2), against engines loaded from the model directory."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from flexrl_ds.models.loading import load_model
from flexrl_ds.rollout.base import RolloutRequest, SamplingParams
from flexrl_ds.rollout.config import HFOptions, RolloutConfig
from flexrl_ds.rollout.hf_engine import HFRolloutEngine
from flexrl_ds.trainer.rollout_host import RolloutHost

SAMPLED = SamplingParams(temperature=1.0, top_k=50, max_new_tokens=6)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)
BUCKET = 7
"""Tensors per `load_weights` call: several buckets, as a weight sync sends them."""


def sync(engine: HFRolloutEngine, model: torch.nn.Module) -> None:
    """What a weight sync does: every parameter by its `named_parameters()` name, in buckets."""
    named = list(model.named_parameters())
    for start in range(0, len(named), BUCKET):
        engine.load_weights(named[start:start + BUCKET])
    engine.reset_caches()


def vl_requests(vl_prompts, seeds):
    """Image, video, mixed and text-only prompts (tests/unit/rollout/conftest.py), a sample per seed."""
    return [RolloutRequest(f"{key}/{seed}", list(ids), list(items), seed)
            for key, (ids, items) in vl_prompts.items() for seed in seeds]


def text_requests(tokenizer, seeds):
    texts = ("the answer is two because", "find the angle of the red triangle")
    return [RolloutRequest(f"{index}/{seed}", tokenizer(text, add_special_tokens=False)["input_ids"], seed=seed)
            for index, text in enumerate(texts) for seed in seeds]


def assert_same_samples(ours, reference):
    for a, b in zip(ours, reference, strict=True):
        assert (a.sample_key, a.response_ids, a.logprobs, a.finish_reason) == \
            (b.sample_key, b.response_ids, b.logprobs, b.finish_reason), a.sample_key


def assert_same_buffers(model, reference):
    """Buffers (rotary inv_freq: never in a weight sync) equal in names, dtypes and values."""
    ours, theirs = dict(model.named_buffers()), dict(reference.named_buffers())
    assert ours.keys() == theirs.keys() and ours
    for name, buffer in theirs.items():
        assert ours[name].dtype == buffer.dtype and torch.equal(ours[name], buffer), name


@pytest.mark.parametrize("arch", ["vl", "q2"])
def test_synced_it_samples_what_an_engine_loaded_from_the_directory_does(arch, rollout_assets, vl_prompts, tokenizer):
    """Given every weight by a sync (from a model loaded on its own), the same tokens and the same
    log-probs as an engine that loaded the directory, sampled and greedy, on image, video, mixed and
    text prompts."""
    model_dir = rollout_assets[arch]
    engine = HFRolloutEngine(model_dir, device="cpu", load_weights_at_start=False)
    assert all(parameter.numel() == 0 for parameter in engine.model.parameters())
    reference = HFRolloutEngine(model_dir, device="cpu")
    assert_same_buffers(engine.model, reference.model)
    sync(engine, load_model(model_dir))
    engine.wake()  # as the trainer does before a rollout; a fresh engine also generates without
    requests = vl_requests(vl_prompts, (1, 2)) if arch == "vl" else text_requests(tokenizer, (1, 2))
    for params in (SAMPLED, GREEDY):
        assert_same_samples(engine.generate(requests, params), reference.generate(requests, params))
    assert engine.is_vision_language is reference.is_vision_language is (arch == "vl")
    assert engine.pad_token_id == reference.pad_token_id
    assert engine.model.generation_config.to_dict() == reference.model.generation_config.to_dict()


def test_it_refuses_to_generate_or_wake_until_every_weight_is_written(rollout_assets, vl_prompts):
    engine = HFRolloutEngine(rollout_assets["vl"], device="cpu", load_weights_at_start=False)
    named = list(load_model(rollout_assets["vl"]).named_parameters())
    request = vl_requests(vl_prompts, (0,))[:1]
    first = sorted(name for name, _ in named)[:5]
    with pytest.raises(RuntimeError, match=re.escape(
            f"hf engine: generate after a start without weights with {len(named)} weights not written since "
            f"(a weight sync must load every one): {', '.join(first)}, ...")):
        engine.generate(request, GREEDY)
    engine.load_weights(named[:-1])
    for action, call in (("generate", lambda: engine.generate(request, GREEDY)), ("wake", engine.wake)):
        with pytest.raises(RuntimeError, match=re.escape(
                f"hf engine: {action} after a start without weights with 1 weights not written since "
                f"(a weight sync must load every one): {named[-1][0]}")):
            call()
    engine.load_weights(named[-1:])
    engine.wake()
    assert engine.generate(request, GREEDY)[0].response_ids
    engine.sleep()  # level 2: frees the weights again; generate names the sleep, not missing weights
    with pytest.raises(RuntimeError, match=re.escape("hf engine: generate while asleep (call wake first)")):
        engine.generate(request, GREEDY)


@pytest.mark.parametrize("damage", ["corrupted", "missing"])
def test_it_reads_no_weight_file(damage, rollout_assets, vl_prompts, tmp_path):
    """A directory whose weight file is garbage or gone, with its config intact: loading it fails,
    starting without weights does not, and after a sync the engine samples as one that loaded the
    intact directory."""
    model_dir = tmp_path / "model"
    shutil.copytree(rollout_assets["vl"], model_dir)
    weights = model_dir / "model.safetensors"
    assert weights.is_file()
    if damage == "corrupted":
        weights.write_bytes(b"\x00not a safetensors file" * 100)
    else:
        weights.unlink()
    with pytest.raises(Exception):
        load_model(str(model_dir))
    engine = HFRolloutEngine(model_dir, device="cpu", load_weights_at_start=False)
    sync(engine, load_model(rollout_assets["vl"]))
    requests = vl_requests(vl_prompts, (3,))
    reference = HFRolloutEngine(rollout_assets["vl"], device="cpu")
    assert_same_samples(engine.generate(requests, SAMPLED), reference.generate(requests, SAMPLED))


def test_bfloat16_gets_the_dtypes_of_a_loaded_model(rollout_assets):
    model_dir = rollout_assets["vl"]
    engine = HFRolloutEngine(model_dir, dtype="bfloat16", device="cpu", load_weights_at_start=False)
    loaded = load_model(model_dir, "bfloat16")
    assert {name: p.dtype for name, p in engine.model.named_parameters()} == \
        {name: p.dtype for name, p in loaded.named_parameters()}
    assert_same_buffers(engine.model, loaded)
    sync(engine, loaded)
    assert all(torch.equal(p, dict(loaded.named_parameters())[name]) for name, p in engine.model.named_parameters())


def test_tied_embeddings_stay_tied(rollout_assets, tokenizer, tmp_path):
    """Qwen2.5-VL 3B ties lm_head to the input embeddings: `named_parameters()` (hence the sync) then
    names only the embeddings, and the engine's lm_head must follow what the sync writes there."""
    from safetensors.torch import load_file, save_file

    model_dir = tmp_path / "tied"
    shutil.copytree(rollout_assets["q2"], model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(model_dir / "model.safetensors")  # a tied checkpoint holds no lm_head of its own
    save_file({name: tensor for name, tensor in weights.items() if name != "lm_head.weight"},
              model_dir / "model.safetensors", metadata={"format": "pt"})
    loaded = load_model(str(model_dir))
    assert "lm_head.weight" not in dict(loaded.named_parameters())
    engine = HFRolloutEngine(model_dir, device="cpu", load_weights_at_start=False)
    assert engine.model.lm_head.weight is engine.model.get_input_embeddings().weight
    sync(engine, loaded)
    reference = HFRolloutEngine(model_dir, device="cpu")
    requests = text_requests(tokenizer, (4,))
    assert_same_samples(engine.generate(requests, SAMPLED), reference.generate(requests, SAMPLED))


def test_a_model_and_no_weights_at_start_is_refused(rollout_assets):
    with pytest.raises(ValueError, match="load_weights_at_start=False builds the model from model_dir's config"):
        HFRolloutEngine(rollout_assets["q2"], device="cpu", model=load_model(rollout_assets["q2"]),
                        load_weights_at_start=False)


def test_no_weights_at_start_with_sleep_level_1_is_refused(rollout_assets):
    """Level 1 keeps the weights in host memory while asleep; a start without weights leaves them to a
    sync that writes them on the device (the trainer asks it only at level 2)."""
    with pytest.raises(ValueError, match="load_weights_at_start=False needs sleep_level 2"):
        HFRolloutEngine(rollout_assets["q2"], device="cpu", sleep_level=1, load_weights_at_start=False)


def test_a_colocated_host_at_level_2_starts_its_engine_without_weights(rollout_assets):
    """The run config's default (hf, sleep_level 2) reaches the engine a policy rank's host builds;
    a separate host, or level 1, loads the directory as before."""
    def host(colocated: bool, **hf):
        options = RolloutConfig(backend="hf", hf=HFOptions(**hf)).engine_options(colocated=colocated)
        return RolloutHost("hf", rollout_assets["q2"], pixels=None, device="cpu", engine_options=options).engine

    colocated = host(True)
    assert colocated._dropped == set(colocated._shapes) and colocated._shapes
    for engine in (host(False), host(True, sleep_level=1)):
        assert not engine._dropped and all(p.numel() > 0 for p in engine.model.parameters())
