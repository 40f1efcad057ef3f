"""The hf rollout engine on a tiny random Qwen2.5-VL with image and video prompts."""

from __future__ import annotations

import re

import pytest
import torch
import transformers

from flexrl_ds.models.flex_model import reference_inputs
from flexrl_ds.models.loading import load_model
from flexrl_ds.models.processing import EncodedSample, VisionItem
from flexrl_ds.rollout.base import RolloutRequest, SamplingParams
from flexrl_ds.rollout.hf_engine import HFRolloutEngine

PARAMS = SamplingParams(temperature=1.0, top_k=50, max_new_tokens=6)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


@pytest.fixture(scope="module")
def vl_engine(rollout_assets):
    return HFRolloutEngine(rollout_assets["vl"], device="cpu")


@pytest.fixture(scope="module")
def hf_vl_model(rollout_assets):
    return load_model(rollout_assets["vl"])


def requests_of(vl_prompts, seeds):
    requests = []
    for key, (prompt_ids, items) in vl_prompts.items():
        requests += [RolloutRequest(f"{key}/{seed}", list(prompt_ids), list(items), seed) for seed in seeds]
    return requests


def plain_forward_logprobs(model, request, result):
    """Log-probs of the result's tokens from one plain HF forward of prompt + response."""
    full = EncodedSample(request.sample_key, torch.tensor(request.prompt_ids + result.response_ids),
                         len(request.prompt_ids), request.items)
    with torch.no_grad():
        logits = model(**reference_inputs(model, full)).logits[0].float()
    start, ids = full.response_start, full.input_ids
    return torch.log_softmax(logits[start - 1:-1], dim=-1).gather(-1, ids[start:, None])[:, 0]


def test_pixels_matter(vl_engine, vl_prompts):
    """The prompts' pixels reach the model: other pixels, other greedy responses."""
    requests = requests_of({key: vl_prompts[key] for key in ("r0", "r1")}, seeds=(0,))
    changed = [RolloutRequest(r.sample_key, r.prompt_ids, [VisionItem(i.kind, i.pixel_values.flip(0), i.grid_thw,
                                                                      i.second_per_grid_t) for i in r.items], 0)
               for r in requests]
    for a, b in zip(vl_engine.generate(requests, GREEDY), vl_engine.generate(changed, GREEDY)):
        assert a.logprobs != pytest.approx(b.logprobs, abs=1e-4)


def test_batched_equals_unbatched_and_logprobs_equal_a_plain_forward(vl_engine, vl_prompts, hf_vl_model):
    requests = requests_of(vl_prompts, seeds=(1, 2))
    batched = vl_engine.generate(requests, PARAMS)
    vl_engine.max_batch_sequences = 1
    try:
        unbatched = vl_engine.generate(requests, PARAMS)
    finally:
        vl_engine.max_batch_sequences = 64
    for request, got, alone in zip(requests, batched, unbatched):
        assert got.sample_key == alone.sample_key == request.sample_key
        assert got.response_ids == alone.response_ids
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        torch.testing.assert_close(torch.tensor(got.logprobs), plain_forward_logprobs(hf_vl_model, request, got),
                                   atol=1e-4, rtol=0)
    assert batched[0].response_ids != batched[1].response_ids


def test_greedy_equals_hf_generate(vl_engine, vl_prompts, hf_vl_model):
    requests = requests_of(vl_prompts, seeds=(0,))
    for request, result in zip(requests, vl_engine.generate(requests, GREEDY)):
        prompt = EncodedSample(request.sample_key, torch.tensor(request.prompt_ids), len(request.prompt_ids),
                               request.items)
        inputs = reference_inputs(hf_vl_model, prompt)
        expected = hf_vl_model.generate(**inputs, attention_mask=torch.ones_like(inputs["input_ids"]),
                                        do_sample=False, max_new_tokens=GREEDY.max_new_tokens,
                                        eos_token_id=None, pad_token_id=0)
        assert result.response_ids == expected[0, len(request.prompt_ids):].tolist()


def test_pad_count_mismatch_names_the_sample(vl_engine, vl_prompts):
    request = requests_of({"r0": vl_prompts["r0"]}, seeds=(0,))[0]
    request.items = request.items + request.items
    with pytest.raises(ValueError, match="'r0/0'.*image pad tokens"):
        vl_engine.generate([request], GREEDY)


def test_a_static_kv_cache_samples_what_the_dynamic_one_does(rollout_assets, vl_engine, vl_prompts, hf_vl_model):
    """kv_cache "static" (allocated once per call): the same tokens as the dynamic cache on padded
    batches of image, video and text prompts, and log-probs equal to a plain forward's."""
    static = HFRolloutEngine(rollout_assets["vl"], device="cpu", model=hf_vl_model, kv_cache="static")
    requests = requests_of(vl_prompts, seeds=(3, 4))
    dynamic_caches, dynamic_results = _caches_used(vl_engine, requests)
    static_caches, static_results = _caches_used(static, requests)
    assert (dynamic_caches, static_caches) == ({"DynamicCache"}, {"StaticCache"})
    for request, ours, reference in zip(requests, static_results, dynamic_results):
        assert ours.response_ids == reference.response_ids, request.sample_key
        torch.testing.assert_close(torch.tensor(ours.logprobs), plain_forward_logprobs(hf_vl_model, request, ours),
                                   atol=1e-4, rtol=0)


def _caches_used(engine, requests):
    """(names of the KV cache classes the engine's forward calls got, the engine's results)."""
    caches = set()
    hook = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: caches.update(type(value).__name__ for value in kwargs.values()
                                                   if isinstance(value, transformers.Cache)), with_kwargs=True)
    try:
        return caches, engine.generate(requests, PARAMS)
    finally:
        hook.remove()


def test_an_unknown_kv_cache_is_refused(rollout_assets):
    with pytest.raises(ValueError, match=re.escape("kv_cache: dynamic | static, got 'paged'")):
        HFRolloutEngine(rollout_assets["vl"], device="cpu", kv_cache="paged")


def test_the_run_configs_kv_cache_reaches_the_hosts_engine(rollout_assets):
    """`flexrl.rollout.hf.kv_cache` from a run's JSON gets to the engine a rollout host builds."""
    import json

    from flexrl_ds.common.typed import from_dict
    from flexrl_ds.rollout.config import RolloutConfig
    from flexrl_ds.trainer.rollout_host import RolloutHost

    # both values differ from the defaults (dynamic, 2), so an ignored setting fails here
    config = from_dict(RolloutConfig, json.loads('{"backend": "hf", "hf": {"kv_cache": "static", "sleep_level": 1}}'),
                       "flexrl.rollout")
    host = RolloutHost("hf", rollout_assets["vl"], pixels=None, device="cpu",
                       engine_options=config.engine_options(colocated=True))
    assert (host.engine.kv_cache, host.engine.sleep_level) == ("static", 1)


def test_a_sleep_at_level_2_frees_the_weights_and_a_full_sync_brings_back_the_same_samples(
        rollout_assets, vl_engine, vl_prompts, hf_vl_model):
    """Level 2 frees every weight; waking before each is written again is refused naming them;
    after a sync of all of them the engine samples what an engine that kept its weights does."""
    engine = HFRolloutEngine(rollout_assets["vl"], device="cpu", model=load_model(rollout_assets["vl"]), sleep_level=2)
    engine.sleep()
    assert all(parameter.numel() == 0 for parameter in engine.model.parameters())
    named = list(hf_vl_model.named_parameters())
    engine.load_weights(named[:-1])
    with pytest.raises(RuntimeError, match=re.escape(f"1 weights not written since (a weight sync must load every "
                                                     f"one): {named[-1][0]}")):
        engine.wake()
    engine.load_weights(named[-1:])
    engine.wake()
    requests = requests_of(vl_prompts, seeds=(5,))
    for ours, reference in zip(engine.generate(requests, PARAMS), vl_engine.generate(requests, PARAMS)):
        assert (ours.response_ids, ours.logprobs) == (reference.response_ids, reference.logprobs), ours.sample_key


def test_an_unknown_sleep_level_is_refused(rollout_assets):
    with pytest.raises(ValueError, match=re.escape("sleep_level: 1 or 2, got 3")):
        HFRolloutEngine(rollout_assets["vl"], device="cpu", sleep_level=3)
