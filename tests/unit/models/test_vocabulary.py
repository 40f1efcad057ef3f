"""The real-vocabulary tokenizer (models/vocabulary.py): exactly the rows asked for, text round-trips,
the tiny model loads and runs with it through the trainer's loaders (AutoTokenizer, SampleEncoder)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from flexrl_ds.cli.main import main
from flexrl_ds.models.tiny import SPECIAL_TOKENS, TinyModelConfig, build_tokenizer
from flexrl_ds.models.vocabulary import QWEN_VL_VOCAB_SIZE

TEXT = "Find the measure of angle ABC. Answer: 42° (rounded) — naïve café\n"


@pytest.fixture(scope="module")
def real_vocab_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("real_vocab") / "vl"
    assert main(["make-tiny-model", "--out", str(out), "--seed", "3", "--vocab-size", str(QWEN_VL_VOCAB_SIZE)]) == 0
    return out


def test_tokenizer_has_the_rows_and_round_trips(real_vocab_model):
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(real_vocab_model)
    assert len(tokenizer) == QWEN_VL_VOCAB_SIZE
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == TEXT
    # the reference: the tiny tokenizer of the same trained BPE gives the same ordinary ids
    tiny = build_tokenizer(TinyModelConfig(out_dir="unused"))
    assert ids == tiny(TEXT, add_special_tokens=False)["input_ids"]
    # specials last (Qwen's order), each one token, every id a row of the model
    special_ids = [tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS]
    assert sorted(special_ids) == list(range(QWEN_VL_VOCAB_SIZE - len(SPECIAL_TOKENS), QWEN_VL_VOCAB_SIZE))
    for token in SPECIAL_TOKENS:
        assert tokenizer(token, add_special_tokens=False)["input_ids"] == [tokenizer.convert_tokens_to_ids(token)]
    # every id decodes (fillers to their own text), and distinct ids are distinct tokens
    vocab = tokenizer.get_vocab()
    assert len(vocab) == QWEN_VL_VOCAB_SIZE and sorted(vocab.values()) == list(range(QWEN_VL_VOCAB_SIZE))
    filler = QWEN_VL_VOCAB_SIZE - len(SPECIAL_TOKENS) - 1
    assert tokenizer.decode([filler]).startswith(" fill")


def test_model_rows_and_the_trainers_loaders(real_vocab_model, tmp_path):
    import transformers

    from flexrl_ds.models.loading import load_model, ordinary_token_bound
    from flexrl_ds.models.processing import SampleEncoder

    model = load_model(str(real_vocab_model))
    assert model.get_input_embeddings().weight.shape[0] == QWEN_VL_VOCAB_SIZE
    assert model.lm_head.weight.shape[0] == QWEN_VL_VOCAB_SIZE
    assert model.config.get_text_config().vocab_size == QWEN_VL_VOCAB_SIZE
    assert ordinary_token_bound(model.config) == QWEN_VL_VOCAB_SIZE - len(SPECIAL_TOKENS) + SPECIAL_TOKENS.index("<|vision_start|>")
    encoder = SampleEncoder(real_vocab_model)  # the trainer's encoder: AutoTokenizer + the processor files
    sample = encoder.encode_items("r", "What is it?", TEXT, [])
    assert encoder.tokenizer.decode(sample.input_ids[sample.response_start:].tolist()) == TEXT
    with torch.no_grad():
        logits = model(input_ids=sample.input_ids.unsqueeze(0)).logits
    assert logits.shape == (1, len(sample.input_ids), QWEN_VL_VOCAB_SIZE)
    reference = transformers.AutoTokenizer.from_pretrained(real_vocab_model)
    rendered = reference.apply_chat_template([{"role": "user", "content": "What is it?"}],
                                             add_generation_prompt=True, tokenize=False)
    assert sample.input_ids[:sample.response_start].tolist() == reference(rendered, add_special_tokens=False)["input_ids"]


def test_vocab_size_too_small_is_a_user_error():
    with pytest.raises(ValueError, match="--vocab-size"):
        TinyModelConfig(out_dir="x", vocab_size=100)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                    reason="transformers' video processor (AutoProcessor) needs torchvision")
def test_auto_processor_loads_with_the_real_vocabulary(real_vocab_model):
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(real_vocab_model)
    assert len(processor.tokenizer) == QWEN_VL_VOCAB_SIZE
    assert processor.tokenizer.convert_tokens_to_ids("<|image_pad|>") == processor.image_token_id
