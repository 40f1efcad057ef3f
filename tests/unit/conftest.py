"""Fixtures shared by unit tests of several folders."""

from __future__ import annotations

import pytest
import torch
import transformers


@pytest.fixture(scope="session")
def tiny_decoder():
    """A tiny random Qwen2 decoder with eager attention (every query-key pair computed, so torch's
    FLOP counter sees them all): the reference for models/flops.py and bench/rollout_floor.py."""
    config = transformers.Qwen2Config(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                                      num_hidden_layers=3, intermediate_size=96, vocab_size=120,
                                      tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(config).eval()
