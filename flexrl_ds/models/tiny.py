"""Tiny random Qwen2.5-VL / Qwen3-VL (dense, MoE) / Qwen2 models with a locally built tokenizer and processor (no hub).

`make_tiny_model(TinyModelConfig(out_dir=...))` writes a directory that loads with
`AutoModelForImageTextToText.from_pretrained(dir)` (qwen2.5-vl) or `AutoModelForCausalLM` (qwen2), and
`AutoTokenizer` / `AutoImageProcessor.from_pretrained(dir)`; `AutoProcessor.from_pretrained(dir)` also
works where torchvision is installed (transformers' Qwen2-VL *video* processor needs it, and the CPU
environment has none: PyPI's torchvision wheel is CUDA-linked). flexrl_ds.models.processing builds the
same model inputs without torchvision.

The tokenizer is a byte-level BPE trained at build time on a small fixed corpus (deterministic), grown
to `vocab_size` entries with generated filler tokens where one is given (models/vocabulary.py: 151,936
for the real Qwen2.5-VL / Qwen3-VL shapes), with
Qwen's special tokens (<|im_start|>, <|vision_start|>, <|image_pad|>, <|video_pad|>, ...) and a chat
template that renders images/videos as `<|vision_start|><|image_pad|><|vision_end|>` like Qwen2.5-VL's.
Shapes are chosen to exercise the hard cases of FlexUlysses: 10 query heads and 2 KV heads (uneven
heads at degrees 4 and 8, GQA with fewer KV heads than the degree), mRoPE with head_dim 8
(`mrope_section` sums to head_dim/2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from flexrl_ds.models.vocabulary import with_filler_tokens

ARCHES = ("qwen2.5-vl", "qwen2", "qwen3-vl", "qwen3-vl-moe")

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Written for this project (same rendering rules as Qwen2.5-VL's template: default system turn,
# images/videos as vision_start + pad + vision_end, generation prompt "<|im_start|>assistant\n").
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'video' -%}{{ '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

_CORPUS_WORDS = (
    "the a an of to in is are was be and or not what which who why how when where find measure angle "
    "triangle circle line point area length answer question video image frame boy girl ball dog cat "
    "picked up because then first after before left right top bottom red blue green yellow black white "
    "one two three four five six seven eight nine ten zero degrees equal value solve compute step "
    "therefore so thus we have let given reason think final option A B C D yes no man woman person "
    "running walking holding table chair room outside inside small large many few count number"
).split()


@dataclass(frozen=True)
class TinyModelConfig:
    """What `flexrl make-tiny-model` builds."""

    out_dir: str
    """Directory to write (created; existing files are overwritten)."""
    arch: str = "qwen2.5-vl"
    """'qwen2.5-vl' (Qwen2_5_VLForConditionalGeneration), 'qwen3-vl' (Qwen3VLForConditionalGeneration:
    patch 16, DeepStack after the first decoder layers), 'qwen3-vl-moe' (Qwen3VLMoeForConditionalGeneration)
    or 'qwen2' (Qwen2ForCausalLM)."""
    seed: int = 0
    """Seed of the random weights."""
    bpe_vocab_size: int = 600
    """Size of the trained byte-level BPE vocabulary (before special tokens)."""
    vocab_size: int | None = None
    """Tokenizer entries and embedding / LM-head rows, filled with generated tokens past the trained
    BPE (models/vocabulary.py; 151,936: Qwen2.5-VL's and Qwen3-VL's). None: the trained BPE and the
    special tokens only (~614), rows rounded up to a multiple of 64."""
    hidden_size: int = 80
    """LLM hidden size (= num_attention_heads * head_dim)."""
    num_attention_heads: int = 10
    """LLM query heads (10: uneven over degree 4 (3,3,2,2) and degree 8 (2,2,1,...))."""
    num_key_value_heads: int = 2
    """LLM KV heads (2: fewer than degrees 4/8, so KV heads are replicated)."""
    num_hidden_layers: int = 2
    """LLM decoder layers."""
    intermediate_size: int = 128
    """LLM MLP width."""
    vision_hidden_size: int = 32
    """Vision tower width."""
    vision_depth: int = 2
    """Vision tower blocks (Qwen2.5-VL: the last one full attention, the others windowed, unless
    `vision_overrides` names `fullatt_block_indexes`)."""
    vision_num_heads: int = 2
    """Vision attention heads (Qwen2.5-VL: 16, head_dim 80; vLLM's vision attention needs head_dim <= 256)."""
    min_pixels: int = 4 * 28 * 28
    """Image/video frame resize lower bound in pixels (Qwen2-VL smart_resize)."""
    max_pixels: int = 64 * 28 * 28
    """Image/video frame resize upper bound in pixels."""
    text_overrides: dict = field(default_factory=dict)
    """Fields of the HF text config set after the ones above (a released model's shape: e.g. Qwen3-VL's
    `head_dim`, `rope_parameters`, the MoE's `num_experts`)."""
    vision_overrides: dict = field(default_factory=dict)
    """Fields of the HF vision config set after the ones above (e.g. `intermediate_size`,
    `deepstack_visual_indexes`)."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHES:
            raise ValueError(f"--arch must be one of {', '.join(ARCHES)}, got {self.arch!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        if self.vocab_size is not None and self.vocab_size < self.bpe_vocab_size + len(SPECIAL_TOKENS):
            raise ValueError(f"--vocab-size: at least {self.bpe_vocab_size + len(SPECIAL_TOKENS)} (the trained BPE and "
                             f"{len(SPECIAL_TOKENS)} special tokens), got {self.vocab_size}")
        if self.vision_hidden_size % self.vision_num_heads:
            raise ValueError("vision_hidden_size must be divisible by vision_num_heads")
        head_dim = self.hidden_size // self.num_attention_heads
        if head_dim % 4:
            raise ValueError(f"head_dim {head_dim} must be a multiple of 4 (mRoPE sections)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def mrope_section(self) -> list[int]:
        """Temporal/height/width split of the rotary half-dimension; sums to head_dim / 2."""
        half = self.head_dim // 2
        spatial = half // 4
        return [half - 2 * spatial, spatial, spatial]


def build_tokenizer(config: TinyModelConfig):
    """A byte-level BPE fast tokenizer with Qwen's special tokens and the chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.bpe_vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    corpus = [" ".join(_CORPUS_WORDS[i:] + _CORPUS_WORDS[:i]) for i in range(len(_CORPUS_WORDS))]
    corpus += ["0123456789 .,;:!?()[]{}+-*/=<>\n"] * 8
    backend.train_from_iterator(corpus, trainer=trainer)
    if config.vocab_size is not None:  # the specials come after the fillers, as in Qwen's vocabulary
        backend = with_filler_tokens(backend, config.vocab_size - len(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _token_id(tokenizer, token: str) -> int:
    token_id = tokenizer.convert_tokens_to_ids(token)
    assert isinstance(token_id, int) and token_id != tokenizer.unk_token_id, token
    return token_id


def _text_kwargs(config: TinyModelConfig, vocab_size: int, tokenizer) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        bos_token_id=_token_id(tokenizer, "<|endoftext|>"),
        eos_token_id=_token_id(tokenizer, "<|im_end|>"),
        pad_token_id=_token_id(tokenizer, "<|endoftext|>"),
        tie_word_embeddings=False,
    )


def build_model(config: TinyModelConfig, tokenizer):
    """The random model (fp32) matching `tokenizer`'s vocabulary."""
    import torch
    import transformers

    model_config = build_model_config(config, tokenizer)
    torch.manual_seed(config.seed)
    return getattr(transformers, ARCH_CLASSES[config.arch])(model_config)


ARCH_CLASSES = {"qwen2": "Qwen2ForCausalLM", "qwen2.5-vl": "Qwen2_5_VLForConditionalGeneration",
                "qwen3-vl": "Qwen3VLForConditionalGeneration", "qwen3-vl-moe": "Qwen3VLMoeForConditionalGeneration"}
"""The HF model class of each `--arch`."""


def build_model_config(config: TinyModelConfig, tokenizer):
    """The HF config of the model `build_model` makes (benchmarks build large shapes from it on a GPU)."""
    import transformers

    vocab_size = config.vocab_size or (len(tokenizer) + 63) // 64 * 64
    text = _text_kwargs(config, vocab_size, tokenizer)
    if config.arch == "qwen2":
        return transformers.Qwen2Config(**dict(text, rope_theta=10000.0, **config.text_overrides))
    if config.arch.startswith("qwen3-vl"):
        return _qwen3_vl_config(config, text, tokenizer)
    text_config = dict(text, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "mrope_section": config.mrope_section})
    vision_config = dict(
        depth=config.vision_depth,
        hidden_size=config.vision_hidden_size,
        intermediate_size=2 * config.vision_hidden_size,
        num_heads=config.vision_num_heads,
        patch_size=14,
        temporal_patch_size=2,
        spatial_merge_size=2,
        window_size=56,  # 112 in the released models (8 x 8 patches of 14): the tiny test images hold several
        out_hidden_size=config.hidden_size,
        fullatt_block_indexes=[config.vision_depth - 1],
        tokens_per_second=2,
    )
    return transformers.Qwen2_5_VLConfig(
        text_config=dict(text_config, **config.text_overrides),
        vision_config=dict(vision_config, **config.vision_overrides),
        image_token_id=_token_id(tokenizer, "<|image_pad|>"),
        video_token_id=_token_id(tokenizer, "<|video_pad|>"),
        vision_start_token_id=_token_id(tokenizer, "<|vision_start|>"),
        vision_end_token_id=_token_id(tokenizer, "<|vision_end|>"),
        tie_word_embeddings=False,
    )


def _vision_token_ids(tokenizer) -> dict:
    return dict(image_token_id=_token_id(tokenizer, "<|image_pad|>"),
                video_token_id=_token_id(tokenizer, "<|video_pad|>"),
                vision_start_token_id=_token_id(tokenizer, "<|vision_start|>"),
                vision_end_token_id=_token_id(tokenizer, "<|vision_end|>"))


def _qwen3_vl_config(config: TinyModelConfig, text: dict, tokenizer):
    """Qwen3-VL (dense or MoE): interleaved mRoPE, explicit head_dim, DeepStack from the first two
    vision blocks into the first two decoder layers; the MoE has 4 experts, 2 per token, in every layer."""
    import transformers

    text_config = dict(text, head_dim=config.head_dim,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                        "mrope_section": config.mrope_section, "mrope_interleaved": True})
    if config.arch == "qwen3-vl-moe":
        # norm_topk_prob: transformers' Qwen3-VL MoE always renormalises the chosen experts' weights and its
        # config has no such field; vLLM's Qwen3-VL MoE reads it (as released checkpoints' configs carry it)
        text_config.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=config.intermediate_size // 2,
                           decoder_sparse_step=1, norm_topk_prob=True)
    vision_config = dict(depth=config.vision_depth, hidden_size=config.vision_hidden_size,
                         intermediate_size=2 * config.vision_hidden_size, num_heads=config.vision_num_heads,
                         patch_size=16, temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=config.hidden_size,
                         num_position_embeddings=64, deepstack_visual_indexes=list(range(min(2, config.vision_depth))))
    cls = transformers.Qwen3VLMoeConfig if config.arch == "qwen3-vl-moe" else transformers.Qwen3VLConfig
    return cls(text_config=dict(text_config, **config.text_overrides),
               vision_config=dict(vision_config, **config.vision_overrides), tie_word_embeddings=False,
               **_vision_token_ids(tokenizer))


def processor_configs(config: TinyModelConfig) -> dict[str, dict]:
    """preprocessor_config.json and video_preprocessor_config.json contents (Qwen2-VL processors).

    Written as JSON rather than through the processor classes: the video processor class needs
    torchvision, which the CPU environment lacks; the files are what matters for loading elsewhere.
    """
    common = {
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "do_convert_rgb": True, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "size": {"shortest_edge": config.min_pixels, "longest_edge": config.max_pixels},
        "resample": 3, "processor_class": "Qwen2_5_VLProcessor",
    }
    if config.arch.startswith("qwen3-vl"):  # patch 16, mean/std 0.5; a video's size bounds all its frames
        common.update(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3, processor_class="Qwen3VLProcessor",
                      size={"shortest_edge": config.min_pixels * 32 * 32 // (28 * 28),
                            "longest_edge": config.max_pixels * 32 * 32 // (28 * 28)})
    image = dict(common, image_processor_type="Qwen2VLImageProcessor")
    video = dict(common, video_processor_type="Qwen2VLVideoProcessor", do_sample_frames=False,
                 fps=2.0, min_frames=2, max_frames=64)
    if config.arch.startswith("qwen3-vl"):
        video.update(video_processor_type="Qwen3VLVideoProcessor", cap_pixels_per_frame=False,
                     size={"shortest_edge": 2 * config.min_pixels, "longest_edge": 16 * config.max_pixels})
    return {"preprocessor_config.json": image, "video_preprocessor_config.json": video}


def make_tiny_model(config: TinyModelConfig, weights: bool = True) -> Path:
    """Build and save the tiny model, tokenizer and processor files; returns the directory.

    weights=False writes the config without weights (a large shape whose random weights a benchmark
    makes on the GPU, or vLLM's load_format="dummy")."""
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(config)
    if weights:
        build_model(config, tokenizer).save_pretrained(out)
    else:
        model_config = build_model_config(config, tokenizer)
        model_config.architectures = [ARCH_CLASSES[config.arch]]  # a saved model records it; loaders read it
        model_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if config.arch != "qwen2":
        for name, content in processor_configs(config).items():
            (out / name).write_text(json.dumps(content, indent=1) + "\n")
        (out / "processor_config.json").write_text(
            json.dumps({"processor_class": processor_configs(config)["preprocessor_config.json"]["processor_class"]},
                       indent=1) + "\n")
        (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "flexrl_tiny.json").write_text(json.dumps({"arch": config.arch, "seed": config.seed}) + "\n")
    return out
