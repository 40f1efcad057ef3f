"""A tokenizer vocabulary grown to a real model's size with generated filler tokens (no download).

Qwen2.5-VL and Qwen3-VL have 151,936 embedding / LM-head rows (`QWEN_VL_VOCAB_SIZE`): a model with
the tiny tokenizer's ~640 rows never shows the memory and time the vocabulary costs (the
[tokens x vocab] logits, the LM head's FLOPs, the engines' sampling). `with_filler_tokens` takes a
small trained byte-level BPE (models/tiny.py) and appends generated tokens to its vocabulary until it
holds `ordinary_size` entries; the special tokens the caller adds afterwards come last, as in Qwen's
vocabulary (ordinary tokens first, specials after them), so `len(tokenizer)` is exactly the requested
size and `models.loading.ordinary_token_bound` still finds every filler token below the first vision
special token.

The filler tokens are ordinary BPE vocabulary entries without merges: encoding text never produces
them (text round-trips through the trained tokens alone), decoding one gives its text (" fill<n>"),
and a model may sample them like any other row. Building takes well under a second: the vocabulary
is edited in the tokenizer's JSON form, not trained.
"""

from __future__ import annotations

import json

QWEN_VL_VOCAB_SIZE = 151_936
"""Embedding / LM-head rows of Qwen2.5-VL and Qwen3-VL (their config's `vocab_size`)."""

FILLER_PREFIX = "Ġfill"
"""Byte-level form of a filler token's text: 'Ġ' is the byte-level alphabet's space."""


def with_filler_tokens(backend, ordinary_size: int):
    """A copy of `backend` (a `tokenizers.Tokenizer` with a BPE model) whose vocabulary holds exactly
    `ordinary_size` entries: its own first, then filler tokens `Ġfill<n>` with the next ids."""
    state = json.loads(backend.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    if ordinary_size < len(vocab):
        raise ValueError(f"vocab_size: at least {len(vocab)} ordinary tokens the trained BPE needs, "
                         f"got {ordinary_size}")
    next_id = max(vocab.values()) + 1
    assert next_id == len(vocab), "a BPE vocabulary's ids are 0..n-1"
    index = 0
    while next_id < ordinary_size:
        token = f"{FILLER_PREFIX}{index}"
        index += 1
        if token not in vocab:  # the trained tokens keep their ids
            vocab[token] = next_id
            next_id += 1
    from tokenizers import Tokenizer

    return Tokenizer.from_str(json.dumps(state))
