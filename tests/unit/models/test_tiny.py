"""make-tiny-model: the directory loads with the Auto classes and the model runs."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from flexrl_ds.cli.main import main
from flexrl_ds.models.tiny import SPECIAL_TOKENS, TinyModelConfig


def test_cli_builds_loadable_qwen25_vl(tmp_path):
    import transformers

    assert main(["make-tiny-model", "--out", str(tmp_path / "vl"), "--seed", "3"]) == 0
    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "vl")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "vl")
    try:
        image_processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "vl")
    except ImportError:  # transformers 5.17 builds no AutoImageProcessor without torchvision
        assert importlib.util.find_spec("torchvision") is None
        image_processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(tmp_path / "vl")
    config = model.config
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    text = config.text_config
    assert (text.num_attention_heads, text.num_key_value_heads) == (10, 2)
    head_dim = text.hidden_size // text.num_attention_heads
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    for token in SPECIAL_TOKENS:
        assert tokenizer.convert_tokens_to_ids(token) < config.text_config.vocab_size
    assert config.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert config.video_token_id == tokenizer.convert_tokens_to_ids("<|video_pad|>")
    # The chat template renders an image as vision_start + image_pad + vision_end.
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")
    # Text round-trips through the byte-level BPE.
    sentence = "Find the measure of angle ABC. Answer: 42°"
    assert tokenizer.decode(tokenizer(sentence)["input_ids"]) == sentence
    assert image_processor.merge_size == 2 and image_processor.patch_size == 14
    assert json.loads((tmp_path / "vl" / "video_preprocessor_config.json").read_text())["temporal_patch_size"] == 2


def test_same_seed_same_weights_and_qwen2_text(tmp_path):
    import transformers

    main(["make-tiny-model", "--out", str(tmp_path / "a"), "--arch", "qwen2", "--seed", "1"])
    main(["make-tiny-model", "--out", str(tmp_path / "b"), "--arch", "qwen2", "--seed", "1"])
    model_a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "a")
    model_b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b")
    assert type(model_a).__name__ == "Qwen2ForCausalLM"
    for (name, pa), (_, pb) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert torch.equal(pa, pb), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "a")
    ids = torch.tensor([tokenizer("the answer is 7")["input_ids"]])
    assert model_a(input_ids=ids).logits.shape[:2] == ids.shape


def test_bad_arch_is_a_user_error():
    with pytest.raises(ValueError, match="--arch"):
        TinyModelConfig(out_dir="x", arch="llama")


def test_auto_processor_loads_and_matches_shadowloader_where_torchvision_exists(tmp_path):
    """AutoProcessor needs torchvision (transformers' video processor); the CPU install here has no
    usable torchvision, the GPU machine runs this (tests/gpu/run_model_on_gpu_machine.sh)."""
    pytest.importorskip("torchvision", reason="transformers' video processor needs torchvision")
    import numpy as np
    import transformers
    from PIL import Image

    from flexrl_ds.media.config import MediaConfig
    from flexrl_ds.media.preprocess import SamplePreprocessor
    from flexrl_ds.media.types import MediaItem, Record

    main(["make-tiny-model", "--out", str(tmp_path / "vl"), "--seed", "3"])
    processor = transformers.AutoProcessor.from_pretrained(tmp_path / "vl")
    assert processor.video_processor is not None
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 255, size=(150, 230, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "img.png")
    alpha = rng.integers(0, 255, size=(150, 230), dtype=np.uint8)
    Image.fromarray(np.dstack([pixels, alpha])).save(tmp_path / "rgba.png")  # transparency: release-dependent
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    config = MediaConfig().with_processor_dir(tmp_path / "vl")
    image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for name in ("img.png", "rgba.png"):
        with Image.open(tmp_path / name) as image:  # as the file opens: the processor converts to RGB
            expected = processor(text=[text], images=[image], return_tensors="pt")
        path = str(tmp_path / name)
        record = Record(id="r", prompt="<image>q", items=(MediaItem("image", path, source=path),))
        meta, outputs = SamplePreprocessor(config).process(record)
        assert torch.equal(outputs["image_grid_thw"], expected["image_grid_thw"]), name
        torch.testing.assert_close(outputs["pixel_values"], expected["pixel_values"], atol=1e-4, rtol=0,
                                   msg=lambda message: f"{name}: {message}")
        assert int((expected["input_ids"] == image_pad).sum()) == meta.vision_tokens
