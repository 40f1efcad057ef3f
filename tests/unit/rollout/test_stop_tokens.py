"""Stop ids: the tokenizer's eos and the model's `generation_config.json` eos ids (issue 39's defect).

A tiny model whose generation config lists `<|im_end|>` and `<|endoftext|>` (as Qwen2.5-VL-Instruct's
does) and whose weights make both likely: every response must end at its first stop id, whichever of
the two it is. The vLLM engine takes the same `SamplingParams.eos_token_ids` as its `stop_token_ids`
(rollout/vllm_inputs.sampling_kwargs), checked here without vLLM.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from flexrl_ds.rollout.base import RolloutRequest, SamplingParams, stop_token_ids
from flexrl_ds.rollout.vllm_inputs import sampling_kwargs


def _likely(model, token_probs: dict[int, float]) -> None:
    """Make the next-token distribution the same after every token, with `token_probs[t]` the chance
    of t: the residual stream is the (shared) embedding alone, so logits are W @ norm(e)."""
    with torch.no_grad():
        text = model.model
        text.embed_tokens.weight.copy_(torch.randn(text.embed_tokens.weight.shape[1]).expand_as(text.embed_tokens.weight))
        for layer in text.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hidden = text.norm(text.embed_tokens.weight[:1])[0]
        head = model.lm_head.weight
        head.copy_(torch.randn_like(head) * 1e-3)
        vocab = head.shape[0]
        rest = 1 - sum(token_probs.values())
        for token, prob in token_probs.items():  # p_t / p_other = exp(logit_t): others' logits are ~0
            head[token] = hidden / hidden.square().sum() * float(torch.log(torch.tensor(prob * vocab / rest)))


@pytest.fixture(scope="module")
def two_eos_model(tmp_path_factory):
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    out = make_tiny_model(TinyModelConfig(out_dir=str(tmp_path_factory.mktemp("two_eos") / "m"), arch="qwen2", seed=3))
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    im_end, endoftext = (tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    _likely(model, {im_end: 0.04, endoftext: 0.12})
    model.save_pretrained(out)
    config = json.loads((out / "generation_config.json").read_text())
    config["eos_token_id"] = [im_end, endoftext]
    (out / "generation_config.json").write_text(json.dumps(config))
    return out, tokenizer, im_end, endoftext


def test_the_stop_ids_are_the_tokenizers_and_the_generation_configs(two_eos_model, tmp_path):
    out, tokenizer, im_end, endoftext = two_eos_model
    assert tokenizer.eos_token_id == im_end
    assert stop_token_ids(tokenizer.eos_token_id, out) == (im_end, endoftext)
    assert stop_token_ids(7, tmp_path) == (7,)  # no generation config
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    assert stop_token_ids([7, 9], tmp_path) == (7, 9)
    assert stop_token_ids(None, tmp_path) == (9,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "</s>"}))
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
        stop_token_ids(7, tmp_path)


def test_no_response_runs_past_a_stop_id(two_eos_model):
    from flexrl_ds.rollout.hf_engine import HFRolloutEngine

    out, tokenizer, im_end, endoftext = two_eos_model
    engine = HFRolloutEngine(str(out), device="cpu", max_batch_sequences=16)
    prompt = tokenizer("find the angle of the red triangle", add_special_tokens=False)["input_ids"]
    requests = [RolloutRequest(f"p{s}", prompt, seed=s) for s in range(32)]
    stops = stop_token_ids(tokenizer.eos_token_id, out)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, eos_token_ids=stops)
    results = engine.generate(requests, params)
    for result in results:
        ids = result.response_ids
        assert not set(ids[:-1]) & set(stops), (result.sample_key, ids)
        assert result.finish_reason == ("stop" if ids[-1] in stops else "length")
        assert len(result.logprobs) == len(ids)
    ends = [r.response_ids[-1] for r in results]
    assert endoftext in ends and im_end in ends, ends
    # The tokenizer's id alone (the old behaviour) lets the same samples run past <|endoftext|>.
    alone = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=24, eos_token_ids=(im_end,)))
    assert any(endoftext in r.response_ids[:-1] for r in alone)
    assert sampling_kwargs(params, seed=1)["stop_token_ids"] == [im_end, endoftext]
