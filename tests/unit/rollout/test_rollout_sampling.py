"""Seeded sampling against transformers' own warpers; the request grouping; the backend registry."""

from __future__ import annotations

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from flexrl_ds.models.processing import VisionItem
from flexrl_ds.rollout.base import ROLLOUT_BACKENDS, RolloutRequest, SamplingParams, engine_class
from flexrl_ds.rollout.config import BACKEND_NAMES, RolloutConfig
from flexrl_ds.rollout.sampling import row_uniforms, sample_tokens


def hf_filtered_probs(logits_V: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution HF's sampling draws from (temperature, then top-k, then top-p warpers)."""
    scores = logits_V.unsqueeze(0)
    scores = TemperatureLogitsWarper(params.temperature)(None, scores)
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return torch.softmax(scores.double(), dim=-1)[0]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.9, 8, 0.8)])
def test_sampled_frequencies_follow_the_hf_warpers(temperature, top_k, top_p):
    logits = torch.randn(40, generator=torch.Generator().manual_seed(3)) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1)
    num_draws = 20000
    uniforms = (torch.arange(num_draws, dtype=torch.float64) + 0.5) / num_draws  # an even grid over [0, 1)
    tokens = sample_tokens(logits.expand(num_draws, -1), uniforms, params)
    frequencies = torch.bincount(tokens, minlength=40).double() / num_draws
    torch.testing.assert_close(frequencies, hf_filtered_probs(logits, params), atol=2 / num_draws, rtol=0)


def test_suppressed_tokens_are_never_drawn():
    logits = torch.randn(40, generator=torch.Generator().manual_seed(5)) * 2
    suppressed = tuple(int(t) for t in logits.topk(3).indices)  # the three most likely
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=1, suppressed_token_ids=suppressed)
    num_draws = 20000
    uniforms = (torch.arange(num_draws, dtype=torch.float64) + 0.5) / num_draws
    tokens = sample_tokens(logits.expand(num_draws, -1), uniforms, params)
    frequencies = torch.bincount(tokens, minlength=40).double() / num_draws
    masked = logits.index_fill(0, torch.tensor(suppressed), float("-inf"))
    torch.testing.assert_close(frequencies, hf_filtered_probs(masked, params), atol=2 / num_draws, rtol=0)
    assert int(sample_tokens(logits[None], None, SamplingParams(temperature=0, suppressed_token_ids=suppressed))) \
        == int(masked.argmax())


def test_greedy_is_argmax_and_streams_are_per_seed():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_tokens(logits, None, SamplingParams(temperature=0)), logits.argmax(-1))
    streams = row_uniforms([7, 8, 7], 5)
    assert torch.equal(streams[0], streams[2]) and not torch.equal(streams[0], streams[1])
    assert torch.equal(row_uniforms([7], 3)[0], streams[0, :3])


def test_group_requests_batches_identical_prompts_and_packs_whole_groups():
    from flexrl_ds.rollout.hf_engine import group_requests, pack_groups

    pixels = torch.randn(16, 12)
    image = VisionItem("image", pixels, (1, 4, 4))
    same = VisionItem("image", pixels.clone(), (1, 4, 4))
    other = VisionItem("image", pixels + 1, (1, 4, 4))
    requests = [RolloutRequest("a0", [1, 2], [image], 0), RolloutRequest("b0", [1, 3], [], 0),
                RolloutRequest("a1", [1, 2], [same], 1), RolloutRequest("c0", [1, 2], [other], 0),
                RolloutRequest("a2", [1, 2], [image], 2), RolloutRequest("b1", [1, 3], [], 1)]
    assert group_requests(requests, 64) == [[0, 2, 4], [1, 5], [3]]
    assert group_requests(requests, 2) == [[0, 2], [1, 5], [3], [4]]
    assert pack_groups([[0, 2], [1, 5], [3], [4]], 3) == [[[0, 2]], [[1, 5], [3]], [[4]]]


def test_sampling_params_from_config_and_checks():
    config = RolloutConfig(temperature=0.6, top_p=0.9, top_k=20, max_response_length=77)
    assert SamplingParams.from_config(config, [5, 9]) == SamplingParams(0.6, 0.9, 20, 77, (5, 9))
    for bad in ({"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"max_new_tokens": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_backend_registry():
    from flexrl_ds.rollout.hf_engine import HFRolloutEngine

    assert set(ROLLOUT_BACKENDS) == set(BACKEND_NAMES)
    assert engine_class("hf") is HFRolloutEngine
    with pytest.raises(ValueError, match="flexrl.rollout.backend"):
        engine_class("sglang")
    try:
        import vllm  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="vllm"):
            engine_class("vllm")
