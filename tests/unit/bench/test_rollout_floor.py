"""The rollout floor's counts against a real model: its weights, its KV cache, torch's FLOP counter."""

import inspect

import pytest
import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from flexrl_ds.bench.rollout_floor import (DecoderShape, Peaks, decode_step_flops, prefill_flops,
                                           rollout_floor)


@pytest.fixture
def model(tiny_decoder):
    return tiny_decoder


def _shape(model) -> DecoderShape:
    return DecoderShape.from_config(model.config)


def _counted_flops(run) -> int:
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        run()
    return counter.get_total_flops()


def test_matmul_params_are_the_decoder_linears_and_the_lm_head(model):
    linears = sum(module.weight.numel() for module in model.model.layers.modules()
                  if isinstance(module, torch.nn.Linear))
    assert _shape(model).matmul_params() == linears + model.lm_head.weight.numel()


def test_kv_bytes_per_token_is_what_the_cache_holds(model):
    tokens = 11
    with torch.no_grad():
        cache = model(torch.arange(tokens)[None], use_cache=True).past_key_values
    held = sum(tensor.numel() * tensor.element_size() for layer in cache.layers for tensor in (layer.keys, layer.values))
    assert _shape(model).kv_bytes_per_token(dtype_bytes=4) * tokens == held


@pytest.mark.parametrize("prompt_len", [1, 7, 32])
def test_prefill_flops_are_the_counted_ones_less_the_masked_half_of_attention(model, prompt_len):
    """An eager forward computes every query-key pair (the mask zeroes half of them afterwards);
    the floor charges only the causal ones, and the LM head of the last position."""
    counted = _counted_flops(lambda: model(torch.arange(prompt_len)[None], logits_to_keep=1))
    shape = _shape(model)
    masked = shape.attention_flops_per_key() * (prompt_len * prompt_len - prompt_len * (prompt_len + 1) // 2)
    assert counted == prefill_flops(shape, prompt_len) + masked


@pytest.mark.parametrize("position", [1, 9])
def test_decode_step_flops_are_the_counted_ones(model, position):
    with torch.no_grad():
        cache = model(torch.arange(position)[None], use_cache=True).past_key_values
    # transformers 5.24 names the forward's cache argument `cache` (`past_key_values` is deprecated there)
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    counted = _counted_flops(lambda: model(torch.tensor([[3]]), **{keyword: cache}, use_cache=True))
    assert counted == decode_step_flops(_shape(model), position)


def test_the_floor_is_the_slower_of_compute_and_memory_per_phase(model):
    shape = _shape(model)
    weights = shape.matmul_params() * 2
    memory_bound = rollout_floor(shape, 4, 16, 5, Peaks(flops_per_s=1e30, bytes_per_s=1.0))
    kv_reads = sum(4 * (position + 1) * shape.kv_bytes_per_token() for position in range(16, 20))
    assert memory_bound.decode_s == pytest.approx(4 * weights + kv_reads)
    assert memory_bound.prefill_s == pytest.approx(weights + 4 * 16 * shape.kv_bytes_per_token())
    compute_bound = rollout_floor(shape, 4, 16, 5, Peaks(flops_per_s=1.0, bytes_per_s=1e30))
    assert compute_bound.seconds == pytest.approx(
        4 * (prefill_flops(shape, 16) + sum(decode_step_flops(shape, p) for p in range(16, 20))))
    assert compute_bound.tokens == 20 and compute_bound.tokens_per_s == pytest.approx(20 / compute_bound.seconds)


def test_bad_sizes_and_peaks_are_refused_naming_them(model):
    with pytest.raises(ValueError, match="new_tokens must be at least 1, got 4, 16, 0"):
        rollout_floor(_shape(model), 4, 16, 0, Peaks(1.0, 1.0))
    with pytest.raises(ValueError, match="peaks must be positive"):
        Peaks(0.0, 1.0)


def test_a_qwen2_5_vl_config_gives_its_language_model_and_lm_head(tmp_path):
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    model_dir = make_tiny_model(TinyModelConfig(out_dir=str(tmp_path / "vl")), weights=False)
    vl = transformers.Qwen2_5_VLForConditionalGeneration._from_config(transformers.AutoConfig.from_pretrained(str(model_dir)))
    linears = sum(module.weight.numel() for module in vl.model.language_model.layers.modules()
                  if isinstance(module, torch.nn.Linear))
    assert DecoderShape.from_config(vl.config.get_text_config()).matmul_params() == linears + vl.lm_head.weight.numel()
