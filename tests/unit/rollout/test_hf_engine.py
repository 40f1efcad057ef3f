"""The hf rollout engine on a tiny random text model, against plain HF `generate` and forwards."""

from __future__ import annotations

import pytest
import torch
import transformers

from flexrl_ds.rollout.base import RolloutRequest, SamplingParams
from flexrl_ds.rollout.hf_engine import HFRolloutEngine

SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=10)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return {"p": encode("the answer is two because"), "q": encode("find the angle of the red triangle")}


@pytest.fixture(scope="module")
def hf_model(rollout_assets):
    return transformers.AutoModelForCausalLM.from_pretrained(rollout_assets["q2"]).eval()


def by_key(results):
    return {result.sample_key: result for result in results}


def test_response_depends_only_on_its_seed(q2_engine, prompts):
    p, q = prompts["p"], prompts["q"]
    # 4 samples of p: batches of 3 + 1 (max_batch_sequences=3)
    first = by_key(q2_engine.generate([RolloutRequest(f"p{s}", p, seed=s) for s in (5, 6, 7, 8)], SAMPLED))
    # other positions, other batch mates, a longer prompt in the same (left-padded) batch of 3
    second = by_key(q2_engine.generate([RolloutRequest("q5", q, seed=5), RolloutRequest("p8", p, seed=8),
                                        RolloutRequest("p5", p, seed=5)], SAMPLED))
    for key in ("p5", "p8"):
        assert second[key].response_ids == first[key].response_ids
        assert second[key].logprobs == pytest.approx(first[key].logprobs, abs=1e-5)
    alone = q2_engine.generate([RolloutRequest("p6", p, seed=6)], SAMPLED)[0]
    assert alone.response_ids == first["p6"].response_ids
    responses = [tuple(first[f"p{s}"].response_ids) for s in (5, 6, 7, 8)]
    assert len(set(responses)) == 4, "different seeds gave equal responses at temperature 1"
    assert second["q5"].response_ids != first["p5"].response_ids


def test_left_padded_batches_equal_one_call_per_prompt(q2_engine, prompts, tokenizer):
    texts = ("two", "the red ball is left of the blue chair because", "find the angle")
    requests = [RolloutRequest(f"{i}/{s}", tokenizer(t, add_special_tokens=False)["input_ids"], seed=s)
                for i, t in enumerate(texts) for s in (1, 2)]
    assert len({len(r.prompt_ids) for r in requests}) == 3
    q2_engine.max_batch_sequences = 64
    try:
        padded = q2_engine.generate(requests, SAMPLED)
        q2_engine.pad_prompts = False
        alone = q2_engine.generate(requests, SAMPLED)
    finally:
        q2_engine.max_batch_sequences, q2_engine.pad_prompts = 3, True
    for a, b in zip(padded, alone):
        assert a.sample_key == b.sample_key and a.response_ids == b.response_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_greedy_equals_hf_generate(q2_engine, prompts, hf_model):
    results = q2_engine.generate([RolloutRequest(k, ids, seed=0) for k, ids in prompts.items()], GREEDY)
    for result, ids in zip(results, prompts.values()):
        expected = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                     do_sample=False, max_new_tokens=GREEDY.max_new_tokens, eos_token_id=None,
                                     pad_token_id=0)
        assert result.response_ids == expected[0, len(ids):].tolist()
        assert result.finish_reason == "length"


def test_top_k_1_and_tiny_top_p_equal_greedy(q2_engine, prompts):
    requests = [RolloutRequest(f"p{s}", prompts["p"], seed=s) for s in (1, 2)]
    greedy = q2_engine.generate(requests, GREEDY)
    for params in (SamplingParams(temperature=1.0, top_k=1, max_new_tokens=10),
                   SamplingParams(temperature=0.7, top_p=1e-6, max_new_tokens=10)):
        for got, want in zip(q2_engine.generate(requests, params), greedy):
            assert got.response_ids == want.response_ids


def test_eos_stops_and_nothing_follows_it(q2_engine, prompts):
    requests = [RolloutRequest(f"p{s}", prompts["p"], seed=s) for s in (11, 12, 13)]
    free = q2_engine.generate(requests, SAMPLED)
    assert all(len(r.response_ids) == SAMPLED.max_new_tokens and r.finish_reason == "length" for r in free)
    eos = free[0].response_ids[3]  # row 0 stops at its 4th token; the others where (if) they sample it
    params = SamplingParams(temperature=1.0, max_new_tokens=10, eos_token_ids=(eos,))
    stopped = q2_engine.generate(requests, params)
    for before, after in zip(free, stopped):
        if eos in before.response_ids:
            end = before.response_ids.index(eos) + 1
            assert after.response_ids == before.response_ids[:end] and after.finish_reason == "stop"
        else:
            assert after.response_ids == before.response_ids and after.finish_reason == "length"
        assert len(after.logprobs) == len(after.response_ids)
    assert stopped[0].finish_reason == "stop" and len(stopped[0].response_ids) <= 4
    assert any(len(r.response_ids) > len(stopped[0].response_ids) for r in stopped), "no row outlived row 0"


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_logprobs_equal_a_plain_forward(q2_engine, prompts, hf_model, temperature):
    """Log-probs of the plain forward's logits over the sampling temperature (1 for greedy), before
    top-k / top-p: what the trainer computes for the same tokens."""
    params = SamplingParams(temperature=temperature, top_k=30, top_p=0.9, max_new_tokens=10)
    requests = [RolloutRequest(f"{k}{s}", ids, seed=s) for k, ids in prompts.items() for s in (3, 4)]
    for request, result in zip(requests, q2_engine.generate(requests, params)):
        ids = torch.tensor([request.prompt_ids + result.response_ids])
        with torch.no_grad():
            logits = hf_model(input_ids=ids).logits[0].float() / (temperature or 1.0)
        start = len(request.prompt_ids)
        expected = torch.log_softmax(logits[start - 1:-1], dim=-1).gather(-1, ids[0, start:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)


def test_load_weights_in_buckets_equals_a_fresh_engine(rollout_assets, prompts):
    engine = HFRolloutEngine(rollout_assets["q2"], device="cpu")
    fresh = HFRolloutEngine(rollout_assets["q2_other"], device="cpu")
    requests = [RolloutRequest(f"p{s}", prompts["p"], seed=s) for s in (1, 2)]
    before = engine.generate(requests, SAMPLED)
    named = list(fresh.model.named_parameters())
    for start in range(0, len(named), 4):
        engine.load_weights((name, tensor.detach().clone()) for name, tensor in named[start:start + 4])
    for params in (SAMPLED, GREEDY):
        got, want = engine.generate(requests, params), fresh.generate(requests, params)
        assert [r.response_ids for r in got] == [r.response_ids for r in want]
        for a, b in zip(got, want):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert [r.response_ids for r in before] != [r.response_ids for r in fresh.generate(requests, SAMPLED)]
    with pytest.raises(ValueError, match="not_a_weight"):
        engine.load_weights([("not_a_weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="lm_head.weight"):
        engine.load_weights([("lm_head.weight", torch.zeros(2, 2))])


def test_bad_requests_name_the_sample(q2_engine, prompts, tmp_path):
    from flexrl_ds.models.processing import VisionItem

    item = VisionItem("image", torch.zeros(16, 1176), (1, 4, 4))
    with pytest.raises(ValueError, match="'s1'.*no vision tower"):
        q2_engine.generate([RolloutRequest("s1", prompts["p"], [item], seed=0)], GREEDY)
    with pytest.raises(ValueError, match="'s2'.*empty prompt_ids"):
        RolloutRequest("s2", [], seed=0)
    with pytest.raises(ValueError, match="'s3'.*seed"):
        RolloutRequest("s3", [1], seed=-1)
    short = VisionItem("video", torch.zeros(15, 1176), (2, 4, 2))
    with pytest.raises(ValueError, match=r"'s4'.*video 1 has 15 pixel rows, its grid \(2, 4, 2\) makes 16"):
        RolloutRequest("s4", [1], [item, short], seed=0)
    with pytest.raises(ValueError, match="model_dir"):
        HFRolloutEngine(str(tmp_path))
    with pytest.raises(ValueError, match="dtype"):
        HFRolloutEngine(str(tmp_path), dtype="float33")
