"""Log-probs as logit minus log-sum-exp in byte-budgeted chunks (models/logprob_chunks.py): values and
gradients equal a plain log_softmax reference, and a 151,936-row head over thousands of tokens stays
within the budget (peak of the CPU allocator's tracked allocations, from torch's profiler)."""

from __future__ import annotations

import pytest
import torch

from flexrl_ds.models.logprob_chunks import bytes_per_logit, chunk_tokens, target_logprobs
from flexrl_ds.models.vocabulary import QWEN_VL_VOCAB_SIZE


def reference(logits, targets, temperature):
    """Plain log_softmax over fp32 (fp64) logits, gathered; entropy from the full distribution."""
    logprobs = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature, dim=-1)
    target = logprobs.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    return target, -(logprobs.exp() * logprobs).sum(dim=-1)


def test_chunk_tokens_follow_the_byte_budget():
    # bf16 logits: 2 (logits) + 2 (their gradient) + 2 x 4 (fp32 buffers) = 12 bytes per logit
    assert bytes_per_logit(torch.bfloat16) == 12 and bytes_per_logit(torch.float32) == 16
    assert bytes_per_logit(torch.float64) == 32
    assert chunk_tokens(1 << 30, QWEN_VL_VOCAB_SIZE, torch.bfloat16) == (1 << 30) // (QWEN_VL_VOCAB_SIZE * 12)
    assert chunk_tokens(100, QWEN_VL_VOCAB_SIZE, torch.float32) == 1  # always at least one token
    with pytest.raises(ValueError, match="budget"):
        chunk_tokens(0, 10, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab", [37, QWEN_VL_VOCAB_SIZE])
def test_values_and_gradients_equal_log_softmax(dtype, temperature, vocab):
    generator = torch.Generator().manual_seed(vocab + int(temperature * 10))
    tokens = 24 if vocab > 1000 else 200
    logits = (3 * torch.randn(tokens, vocab, generator=generator)).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), generator=generator)
    targets[::5] = -100  # ignored positions read column 0, as the clamp of the reference
    weights_lp, weights_h = torch.randn(tokens, generator=generator), torch.randn(tokens, generator=generator)
    # fp32 sums over 151,936 terms round differently in the two orders of summation
    tolerance = {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float32: dict(atol=1e-4, rtol=1e-4),
                 torch.float64: dict(atol=1e-9, rtol=1e-9)}[dtype]

    mine = logits.clone().requires_grad_()
    logprobs, entropy = target_logprobs(mine, targets, temperature, with_entropy=True)
    (logprobs * weights_lp + entropy * weights_h).sum().backward()
    plain = logits.clone().requires_grad_()
    expected_lp, expected_h = reference(plain, targets, temperature)
    (expected_lp * weights_lp + expected_h * weights_h).sum().backward()
    torch.testing.assert_close(logprobs.float(), expected_lp.float(), **tolerance)
    torch.testing.assert_close(entropy.float(), expected_h.float(), **tolerance)
    torch.testing.assert_close(mine.grad.float(), plain.grad.float(), **tolerance)
    assert mine.grad.dtype == dtype

    # the log-probs alone, and the entropy as a statistic without a gradient
    alone = logits.clone().requires_grad_()
    logprobs, entropy = target_logprobs(alone, targets, temperature, with_entropy=True, entropy_grad=False)
    assert not entropy.requires_grad
    (logprobs * weights_lp).sum().backward()
    plain = logits.clone().requires_grad_()
    (reference(plain, targets, temperature)[0] * weights_lp).sum().backward()
    torch.testing.assert_close(alone.grad.float(), plain.grad.float(), **tolerance)


def peak_tracked_bytes(function) -> tuple[int, object]:
    """Highest sum of live allocations the CPU allocator reported while `function` ran (torch's
    profiler records every allocation and free with `profile_memory`), and its result."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = function()
    events = sorted((event for event in prof.profiler.kineto_results.events() if event.name() == "[memory]"),
                    key=lambda event: event.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak, result


def test_a_real_vocabulary_head_stays_within_the_budget():
    """FlexUlyssesLM's chunked head (checkpointed lm_head chunks + TargetLogprobs), forward and backward
    over 2,048 tokens and 151,936 rows: the peak stays under the budget plus the LM head's weight
    gradient (twice: the gradient and one chunk's contribution being added to it) and a few
    [tokens x hidden] blocks; the plain fp32 log-softmax would need 1.2 GB for each of its blocks."""
    from flexrl_ds.models.flex_model import FlexUlyssesLM
    from flexrl_ds.models.tiny import TinyModelConfig, build_model, build_tokenizer

    config = TinyModelConfig(out_dir="unused", arch="qwen2", vocab_size=QWEN_VL_VOCAB_SIZE, hidden_size=40,
                             num_attention_heads=5, num_key_value_heads=1, num_hidden_layers=1)
    model = build_model(config, build_tokenizer(config))
    budget = 64 << 20
    flex = FlexUlyssesLM(model, logits_chunk_bytes=budget, temperature=0.9)
    tokens = 2048
    assert flex.chunk_tokens(torch.float32) == budget // (QWEN_VL_VOCAB_SIZE * 16) < tokens // 20
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, config.hidden_size, generator=generator).requires_grad_()
    targets = torch.randint(0, QWEN_VL_VOCAB_SIZE, (tokens,), generator=generator)
    weight = model.lm_head.weight

    def forward_backward():
        logprobs, entropy = flex._token_outputs(hidden, targets, with_entropy=True)
        (logprobs.sum() + 0.01 * entropy.sum()).backward()
        return logprobs.detach()

    peak, logprobs = peak_tracked_bytes(forward_backward)
    constant = 2 * weight.numel() * 4 + 4 * hidden.numel() * 4 + (1 << 20)
    assert peak <= budget + constant, f"peak {peak / 2**20:.1f} MiB over {budget / 2**20:.0f} MiB + {constant / 2**20:.1f} MiB"
    # the same values as the plain reference on a slice (the whole would take 1.2 GB per block)
    with torch.no_grad():
        expected, _ = reference(model.lm_head(hidden[:200]), targets[:200], 0.9)
    torch.testing.assert_close(logprobs[:200], expected, atol=1e-5, rtol=1e-5)
