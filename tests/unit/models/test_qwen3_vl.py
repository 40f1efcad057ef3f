"""Qwen3-VL behind the family seam, against transformers' own code: geometry (its image and video
processors), prompts (its processor's timestamped frame groups), positions (its rope index), and the
FlexUlysses forward on one rank (DeepStack included) against the plain HF forward."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def q3(tmp_path_factory):
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.models.processing import encode_records
    from flexrl_ds.models.sample_data import write_scoring_dataset
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("q3")
    model_dir = make_tiny_model(TinyModelConfig(out_dir=str(root / "q3"), arch="qwen3-vl", seed=3))
    data = write_scoring_dataset(root / "data", num_records=8, seed=4)
    return str(model_dir), load_model(str(model_dir)), encode_records(model_dir, data)


def test_family_is_chosen_by_model_type_and_unshardable_ones_are_refused(q3, tmp_path):
    from flexrl_ds.families import family_of, family_of_dir

    model_dir, model, _ = q3
    assert family_of(model).model_type == family_of_dir(model_dir).model_type == "qwen3_vl"
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5", "vision_config": {}}')
    with pytest.raises(ValueError, match="'qwen3_5' cannot be trained.*Gated DeltaNet"):
        family_of_dir(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llava", "vision_config": {}}')
    with pytest.raises(ValueError, match="'llava' is not supported.*qwen3_vl"):
        family_of_dir(tmp_path)


@pytest.mark.parametrize("size", [(37, 53), (250, 61), (96, 130), (17, 400)])
def test_image_grid_equals_hf_image_processor(q3, size):
    from transformers import Qwen2VLImageProcessorPil

    from flexrl_ds.media.config import MediaConfig
    from flexrl_ds.media.types import MediaInfo, MediaItem
    from flexrl_ds.media.vision_geometry import plan_image

    model_dir = q3[0]
    config = MediaConfig().with_processor_dir(model_dir)
    hf = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    height, width = size
    meta = plan_image(MediaItem("image", "x.png"), MediaInfo(width=width, height=height), config)
    kwargs = {"patch_size": hf.patch_size, "merge_size": hf.merge_size, "size": dict(hf.size)}
    assert config.patch_size == 16 and meta.num_patches == hf.get_number_of_image_patches(height, width, kwargs)


@pytest.mark.parametrize("frames,fps,height,width", [(9, 4.0, 56, 84), (31, 30.0, 361, 203), (7, 2.0, 20, 90),
                                                     (240, 24.0, 480, 640), (5, 3.0, 33, 33)])
@pytest.mark.parametrize("cap", [False, True])
def test_video_frames_and_grid_equal_hf_video_processor(q3, frames, fps, height, width, cap):
    import dataclasses
    import json
    from pathlib import Path

    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from flexrl_ds.media.config import MediaConfig
    from flexrl_ds.media.types import MediaInfo, MediaItem
    from flexrl_ds.media.vision_geometry import plan_video

    model_dir = q3[0]
    saved = json.loads((Path(model_dir) / "video_preprocessor_config.json").read_text())
    saved.update(cap_pixels_per_frame=cap, max_video_tokens=20)
    hf = Qwen3VLVideoProcessor(**{k: v for k, v in saved.items()
                                  if k not in ("video_processor_type", "processor_class")})
    config = dataclasses.replace(MediaConfig().with_processor_dir(model_dir),
                                 video_max_total_tokens=20 if cap else None)
    meta = plan_video(MediaItem("video", "x.mp4"), MediaInfo(width=width, height=height, num_frames=frames, fps=fps),
                      config)
    indices = hf.sample_frames(VideoMetadata(total_num_frames=frames, fps=fps), fps=saved["fps"])
    assert list(meta.frame_indices) == list(indices)
    patches = hf.get_num_of_video_patches(len(indices), height, width, {"cap_pixels_per_frame": cap})
    assert meta.num_patches == patches


def test_prompt_timestamps_equal_hf_processor(q3):
    import transformers
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from flexrl_ds.models.processing import SampleEncoder, VisionItem

    model_dir = q3[0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    # its constructor looks up the video processor mapping, which needs torchvision: set what its
    # replacement methods read instead
    processor = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
    processor.tokenizer, processor.video_processor = tokenizer, Qwen3VLVideoProcessor(patch_size=16)
    processor.image_processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.vision_start_token, processor.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    encoder = SampleEncoder(model_dir)
    frames, fps = (0, 3, 7, 10, 14), 7.5  # an odd count: the last group repeats its final frame
    video = VisionItem("video", torch.zeros(0), (3, 4, 6), 1.0, frame_indices=frames, source_fps=fps)
    image = VisionItem("image", torch.zeros(0), (1, 2, 4))
    ours = encoder.encode_prompt("r", "<image>look <video> now?", [image, video])
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "look "}, {"type": "video"},
                                             {"type": "text", "text": " now?"}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = {"image_grid_thw": torch.tensor([[1, 2, 4]]), "video_grid_thw": torch.tensor([[3, 4, 6]]),
              "video_metadata": [VideoMetadata(total_num_frames=15, fps=fps, frames_indices=list(frames))]}
    theirs, _ = processor.get_text_with_replacements([text], [processor.replace_image_token(inputs, 0)],
                                                     [processor.replace_video_token(inputs, 0)])
    assert "<1.1 seconds>" in theirs[0]
    assert ours == tokenizer(theirs[0], add_special_tokens=False)["input_ids"]


def test_positions_equal_hf_rope_index(q3):
    from flexrl_ds.models.flex_model import reference_inputs
    from flexrl_ds.models.positions import sequence_positions

    _, model, samples = q3
    checked = 0
    for sample in samples.values():
        kwargs = reference_inputs(model, sample)
        if "position_ids" in kwargs or not sample.items:
            continue
        theirs, _ = model.model.get_rope_index(kwargs["input_ids"], kwargs["mm_token_type_ids"],
                                               kwargs.get("image_grid_thw"), kwargs.get("video_grid_thw"))
        assert torch.equal(sequence_positions(model, sample.input_ids, sample.items), theirs[:, 0]), sample.id
        checked += 1
    assert checked >= 4 and any(item.grid_thw[0] > 1 for s in samples.values() for item in s.items)


def test_flex_forward_equals_hf_and_needs_deepstack(q3):
    """Degree 1 on one rank equals HF; without the DeepStack rows the log-probs would differ."""
    from flexrl_ds.families.base import DecoderExtras
    from flexrl_ds.models.flex_model import FlexUlyssesLM, build_step_batch, reference_logprobs
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.models.sample_data import random_plan_for

    model_dir, model, samples = q3
    with torch.no_grad():
        reference = {s: reference_logprobs(model, x) for s, x in samples.items()}
        flex = FlexUlyssesLM(load_model(model_dir))
        plan = random_plan_for({s: x.length for s, x in samples.items()}, 1, 1, seed=0)
        batch = build_step_batch(flex.hf_model, plan, samples, 0)
        got = flex(batch).logprobs
        family = flex.family
        _, _, extras = flex.embed(batch)
        assert isinstance(extras, DecoderExtras) and len(extras.features) == 2
        flex.family = type("NoDeepstack", (type(family),), {"num_extra_features": lambda self, config: 0})()
        without = flex(batch).logprobs
    gap = 0.0
    for seq_id, lo, hi, local in batch.layout.segments():
        sample = samples[seq_id]
        piece = slice(local + sample.response_start - 1 - lo, local + hi - lo - 1)
        torch.testing.assert_close(got[piece], reference[seq_id], atol=2e-5, rtol=1e-5)
        gap = max(gap, (without[piece] - reference[seq_id]).abs().max().item())
    assert gap > 1e-3


def test_vllm_request_carries_source_frames_and_fps_for_the_same_timestamps(q3):
    """vLLM's Qwen3-VL builds each group's timestamp from the metadata's frame indices and fps (as
    transformers' processor does): they give the prompt's timestamps, and the size bounds keep the grid."""
    from transformers import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    from flexrl_ds.families.qwen3_vl import group_timestamps
    from flexrl_ds.media.config import MediaConfig
    from flexrl_ds.models.processing import VisionItem
    from flexrl_ds.rollout.vllm_inputs import PixelGeometry, processor_kwargs, video_metadata, vllm_weight_name

    model_dir, model, _ = q3
    geometry = PixelGeometry.from_media_config(MediaConfig().with_processor_dir(model_dir))
    assert geometry.family == "qwen3_vl" and geometry.patch_size == 16
    item = VisionItem("video", torch.zeros(0), (3, 4, 6), 1.0, frame_indices=(2, 9, 17, 24, 31), source_fps=12.5)
    metadata = video_metadata(item, geometry)
    theirs = Qwen3VLProcessor._calculate_timestamps(None, metadata["frames_indices"], metadata["fps"], 2)
    assert theirs == group_timestamps(item.frame_indices, 12.5, 2) and len(theirs) == 3
    size = processor_kwargs([item], geometry)["size"]
    frames = metadata["total_num_frames"]
    assert smart_resize(frames, 4 * 16, 6 * 16, 2, 32, size["shortest_edge"], size["longest_edge"]) == (64, 96)
    assert all(vllm_weight_name(name, "qwen3_vl").startswith(("language_model.", "visual."))
               for name, _ in model.named_parameters())


def test_moe_flops_count_active_experts_only():
    from types import SimpleNamespace

    from flexrl_ds.models.flops import DecoderShape
    from flexrl_ds.planning.cost_model import shapes_from_config

    fields = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
                  intermediate_size=999, vocab_size=100, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24)
    assert DecoderShape.from_config(SimpleNamespace(**fields)).intermediate_size == 48
    assert shapes_from_config({"text_config": fields}, "x").intermediate_size == 48
    dense = {k: v for k, v in fields.items() if k not in ("num_experts", "num_experts_per_tok")}
    assert DecoderShape.from_config(SimpleNamespace(**dense)).intermediate_size == 999


def test_vllm_prompt_collapses_each_videos_frame_groups_to_the_template_wrapper(q3):
    """vLLM's Qwen3-VL replaces the chat template's `<|vision_start|><|video_pad|><|vision_end|>` by the
    groups, each timestamp encoded on its own: re-expanding the collapsed prompt that way gives the
    trainer's prompt back; the video travels with its metadata."""
    import transformers

    from flexrl_ds.media.config import MediaConfig
    from flexrl_ds.models.processing import SampleEncoder, VisionItem
    from flexrl_ds.rollout.base import RolloutRequest
    from flexrl_ds.rollout.vllm_inputs import PixelGeometry, VisionTokens, build_prompt

    model_dir, model, _ = q3
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    geometry = PixelGeometry.from_media_config(MediaConfig().with_processor_dir(model_dir))
    config = model.config
    tokens = VisionTokens(config.image_token_id, config.video_token_id, config.vision_start_token_id,
                          config.vision_end_token_id)
    video = VisionItem("video", torch.zeros(3 * 2 * 4, 1536), (3, 2, 4), 1.0, frame_indices=(0, 4, 8, 12, 16),
                       source_fps=8.0)
    image = VisionItem("image", torch.zeros(4 * 4, 1536), (1, 4, 4))
    ids = SampleEncoder(model_dir).encode_prompt("r", "<video>\nhow many? <image>", [video, image])
    prompt = build_prompt(RolloutRequest("s", ids, [video, image], 0), tokens, geometry, encode)
    collapsed = prompt["prompt_token_ids"]
    wrapper = [tokens.vision_start, tokens.video, tokens.vision_end]
    at = next(i for i in range(len(collapsed)) if collapsed[i:i + 3] == wrapper)
    groups = []
    for stamp in (0.25, 1.25, 2.0):  # (0 + 4) / 2 / 8, (8 + 12) / 2 / 8, (16 + 16) / 2 / 8 (padded)
        groups += encode(f"<{stamp:.1f} seconds>") + [tokens.vision_start] + [tokens.video] * 2 + [tokens.vision_end]
    expanded = collapsed[:at] + groups + collapsed[at + 3:]
    image_at = expanded.index(tokens.image)
    assert expanded[:image_at + 1] + [tokens.image] * 3 + expanded[image_at + 1:] == ids
    frames, metadata = prompt["multi_modal_data"]["video"][0]
    assert frames.shape[0] == 6 and metadata["frames_indices"] == [0, 4, 8, 12, 16, 16] and metadata["fps"] == 8.0


def test_router_aux_loss_equals_transformers_and_idle_rows_are_left_out():
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    from flexrl_ds.models.moe import router_aux_term, router_stats

    gen = torch.Generator().manual_seed(0)
    layers = [torch.randn(13, 6, generator=gen, requires_grad=True) for _ in range(3)]
    term, value = router_aux_term(router_stats(layers, top_k=2))
    expected = load_balancing_loss_func(tuple(layers), 6, 2)
    assert float(value) == pytest.approx(float(expected), rel=1e-6)
    term.backward()
    ours = [layer.grad.clone() for layer in layers]
    for layer in layers:
        layer.grad = None
    expected.backward()
    for mine, theirs in zip(ours, layers):
        torch.testing.assert_close(mine, theirs.grad, rtol=1e-5, atol=1e-7)
    _, idle = router_aux_term(router_stats(layers, top_k=2, num_rows=0))
    assert float(idle) == 0.0


def test_train_and_logprobs_refuse_an_unshardable_family_before_any_worker(tmp_path, capsys):
    from flexrl_ds.cli.main import main
    from flexrl_ds.trainer.validation import check_model_dir

    (tmp_path / "config.json").write_text('{"model_type": "qwen3_5", "vision_config": {}, "text_config": {}}')
    with pytest.raises(ValueError, match="'qwen3_5' cannot be trained by flexrl_ds yet: .*Gated DeltaNet"):
        check_model_dir(str(tmp_path))
    capsys.readouterr()
    assert main(["logprobs", "--model", str(tmp_path), "--data", str(tmp_path / "none.jsonl"), "--nproc", "4",
                 "--out", str(tmp_path / "out.jsonl"), "--loader", "local"]) == 2
    assert "'qwen3_5' cannot be trained" in capsys.readouterr().err


def test_the_released_shapes_land_in_the_hf_config(tmp_path):
    """The GPU runner's Qwen3-VL shapes (bench/rollout_bench.py SHAPES): the overrides reach the HF
    config that make-tiny-model writes, and the model class builds from it (on the meta device)."""
    import torch
    import transformers

    from flexrl_ds.bench.rollout_bench import SHAPES
    from flexrl_ds.models.tiny import ARCH_CLASSES, TinyModelConfig, make_tiny_model

    for name in ("qwen3-vl-8b", "qwen3-vl-moe"):
        shape = dict(SHAPES[name], vocab_size=1024)  # the layers as released, a small vocabulary
        out = make_tiny_model(TinyModelConfig(out_dir=str(tmp_path / name), **shape), weights=False)
        config = transformers.AutoConfig.from_pretrained(str(out))
        for key, value in shape["text_overrides"].items():
            assert getattr(config.text_config, key) == value, (name, key)
        for key, value in shape["vision_overrides"].items():
            assert getattr(config.vision_config, key) == value, (name, key)
        with torch.device("meta"):
            model = getattr(transformers, ARCH_CLASSES[shape["arch"]])._from_config(config)
        attention = model.model.language_model.layers[0].self_attn
        assert attention.q_proj.out_features == config.text_config.num_attention_heads * 128


def _vllm_qwen3_token_prompt_expansion(prompt, tokens, encode, merge, patch, bare_video_pad):
    """What vLLM 0.26's Qwen3-VL makes of a token prompt (qwen3_vl.py `_get_prompt_updates` /
    `get_video_repl`): each image's pad becomes its merged pads (grid from the pixels' size), each
    video's placeholder (a bare pad with transformers >= 5.10, else the template's wrapper) becomes per
    group its timestamp encoded on its own + vision_start + pads + vision_end, the timestamps from the
    metadata's frame indices and fps as transformers' processor computes them."""
    from transformers import Qwen3VLProcessor

    ids, images, videos = list(prompt["prompt_token_ids"]), prompt["multi_modal_data"].get("image", []), \
        list(prompt["multi_modal_data"].get("video", []))
    target = [tokens.video] if bare_video_pad else [tokens.vision_start, tokens.video, tokens.vision_end]
    out, i, image_index = [], 0, 0
    while i < len(ids):
        if ids[i:i + len(target)] == target:
            frames, metadata = videos.pop(0)
            stamps = Qwen3VLProcessor._calculate_timestamps(None, list(metadata["frames_indices"]), metadata["fps"], 2)
            assert len(stamps) == frames.shape[0] // 2
            pads = (frames.shape[1] // patch) * (frames.shape[2] // patch) // merge ** 2
            for stamp in stamps:
                out += encode(f"<{stamp:.1f} seconds>") + [tokens.vision_start] + [tokens.video] * pads + [tokens.vision_end]
            i += len(target)
        elif ids[i] == tokens.image:
            image = images[image_index]
            image_index += 1
            out += [tokens.image] * ((image.shape[0] // patch) * (image.shape[1] // patch) // merge ** 2)
            i += 1
        else:
            out.append(ids[i])
            i += 1
    assert not videos and image_index == len(images)
    return out


@pytest.mark.parametrize("bare_video_pad", [True, False])
def test_vllm_qwen3_expansion_of_the_request_gives_the_trainers_prompt(q3, bare_video_pad):
    """Two videos of several frame groups and an image: vLLM's Qwen3-VL expansion of the request
    (bare `<|video_pad|>` targets as with vLLM 0.26 + transformers >= 5.10, or the old wrapper) is the
    trainer's prompt token for token; the metadata travels with the frames only (a `video_metadata`
    processor kwarg would be a second value for the keyword vLLM passes)."""
    import transformers

    from flexrl_ds.media.config import MediaConfig
    from flexrl_ds.models.processing import SampleEncoder, VisionItem
    from flexrl_ds.rollout.base import RolloutRequest
    from flexrl_ds.rollout.vllm_inputs import PixelGeometry, VisionTokens, build_prompt, vllm_replaces_bare_video_pad

    model_dir, model, _ = q3
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    geometry = PixelGeometry.from_media_config(MediaConfig().with_processor_dir(model_dir),
                                               bare_video_pad=bare_video_pad)
    config = model.config
    tokens = VisionTokens(config.image_token_id, config.video_token_id, config.vision_start_token_id,
                          config.vision_end_token_id)
    gen = torch.Generator().manual_seed(0)
    first = VisionItem("video", torch.rand(3 * 2 * 4, 1536, generator=gen), (3, 2, 4), 1.0,
                       frame_indices=(0, 4, 8, 12, 16), source_fps=8.0)
    second = VisionItem("video", torch.rand(2 * 4 * 2, 1536, generator=gen), (2, 4, 2), 1.0,
                        frame_indices=(3, 40, 77, 114), source_fps=29.97)
    image = VisionItem("image", torch.rand(4 * 4, 1536, generator=gen), (1, 4, 4))
    items = [first, image, second]
    ids = SampleEncoder(model_dir).encode_prompt("r", "<video> then <image> and <video>?", items)
    prompt = build_prompt(RolloutRequest("s", ids, items, 0), tokens, geometry, encode)
    expanded = _vllm_qwen3_token_prompt_expansion(prompt, tokens, encode, geometry.merge_size, geometry.patch_size,
                                                  bare_video_pad)
    assert expanded == ids
    kwargs = prompt["mm_processor_kwargs"]
    assert "video_metadata" not in kwargs and kwargs["do_sample_frames"] is False
    assert vllm_replaces_bare_video_pad("qwen3_vl") and vllm_replaces_bare_video_pad("qwen3_vl_moe")
    assert not vllm_replaces_bare_video_pad("qwen2_5_vl")


def _vllm_fused_expert_shards(gate_up, down, hidden):
    """vLLM 0.26's reading of fused 3D expert tensors (fused_moe/routed_experts.py `load_weights`): a
    gate_up whose last dim is not the hidden size is transposed, then split in two on dim 1 (w1: gate,
    w3: up, each (experts, intermediate, hidden)); a down whose dim -2 is not the hidden size is
    transposed (w2: (experts, hidden, intermediate))."""
    if gate_up.shape[-1] != hidden:
        gate_up = gate_up.transpose(-1, -2)
    if down.shape[-2] != hidden:
        down = down.transpose(-1, -2)
    w1, w3 = gate_up.chunk(2, dim=1)
    return w1, w3, down


def test_moe_sync_tensors_are_the_fused_expert_layout_vllm_loads(tmp_path):
    """The MoE's in-memory expert parameters (sent by name as they are) read as vLLM reads fused experts
    give each expert's SiLU-gated MLP as transformers computes it; every name maps onto vLLM's modules."""
    import transformers

    from flexrl_ds.models.tiny import TinyModelConfig, build_model, build_tokenizer
    from flexrl_ds.rollout.vllm_inputs import vllm_weight_name

    config = TinyModelConfig(out_dir=str(tmp_path), arch="qwen3-vl-moe", seed=5)
    model = build_model(config, build_tokenizer(config))
    assert isinstance(model, transformers.Qwen3VLMoeForConditionalGeneration)
    params = dict(model.named_parameters())
    text = model.config.get_text_config()
    experts = model.model.language_model.layers[0].mlp.experts
    w1, w3, w2 = _vllm_fused_expert_shards(params["model.language_model.layers.0.mlp.experts.gate_up_proj"].detach(),
                                           params["model.language_model.layers.0.mlp.experts.down_proj"].detach(),
                                           text.hidden_size)
    assert w1.shape == (text.num_experts, text.moe_intermediate_size, text.hidden_size)
    rows = torch.randn(5, text.hidden_size, generator=torch.Generator().manual_seed(0))
    for expert in range(text.num_experts):
        top_k_index = torch.full((5, 1), expert)
        theirs = experts(rows, top_k_index, torch.ones(5, 1)).detach()
        ours = (torch.nn.functional.silu(rows @ w1[expert].T) * (rows @ w3[expert].T)) @ w2[expert].T
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    mapped = [vllm_weight_name(name, "qwen3_vl_moe") for name in params]
    assert all(name.startswith(("language_model.model.", "language_model.lm_head.", "visual.")) for name in mapped)
    assert "language_model.lm_head.weight" in mapped and not text.tie_word_embeddings
