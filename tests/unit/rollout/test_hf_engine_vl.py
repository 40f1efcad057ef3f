"""The hf rollout engine on a tiny random Qwen2.5-VL with image and video prompts."""

from __future__ import annotations

import pytest
import torch

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
        full = EncodedSample(request.sample_key, torch.tensor(request.prompt_ids + got.response_ids),
                             len(request.prompt_ids), request.items)
        with torch.no_grad():
            logits = hf_vl_model(**reference_inputs(hf_vl_model, full)).logits[0].float()
        start, ids = full.response_start, full.input_ids
        expected = torch.log_softmax(logits[start - 1:-1], dim=-1).gather(-1, ids[start:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(got.logprobs), expected, atol=1e-4, rtol=0)
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
