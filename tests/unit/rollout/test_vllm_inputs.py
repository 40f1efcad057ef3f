"""The vllm backend's pure parts (no vLLM here): prompts, pixels, processor settings, results, weight names.

References are independent of the code under test: `image_io.patchify` (which the un-patchify must
invert), transformers' own PIL image processor and VideoMetadata (what vLLM calls), the checkpoint
files `save_pretrained` writes (what vLLM loads), and hand-built expectations.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from flexrl_ds.media import image_io
from flexrl_ds.media.config import MediaConfig
from flexrl_ds.media.preprocess import SamplePreprocessor
from flexrl_ds.media.types import MediaItem, Record
from flexrl_ds.models.processing import VisionItem
from flexrl_ds.rollout.base import RolloutRequest, SamplingParams
from flexrl_ds.rollout.config import HFOptions, RolloutConfig, VLLMOptions
from flexrl_ds.rollout.vllm_inputs import (LOGIT_BIAS_FLOOR, PixelGeometry, VisionTokens, build_prompt,
                                           check_expanded_prompt, check_request_temperature, collapse_vision_pads,
                                           item_media, logprobs_mode, processor_kwargs, sampling_kwargs, to_result,
                                           video_metadata, vllm_weight_name)

GEOMETRY = PixelGeometry()
TOKENS = VisionTokens(image=7, video=8)


@pytest.mark.parametrize("frames,grid_h,grid_w", [(1, 4, 6), (4, 6, 2), (6, 2, 10)])
def test_unpatchify_inverts_patchify(frames, grid_h, grid_w):
    generator = torch.Generator().manual_seed(frames * 100 + grid_h)
    video = torch.randn(frames, 3, grid_h * 14, grid_w * 14, generator=generator)
    rows = image_io.patchify(video, 14, 2, 2)
    grid = (-(-frames // 2), grid_h, grid_w)
    restored = image_io.unpatchify(rows, grid, 14, 2, 2)
    padded = torch.cat([video, video[-1:].expand(-frames % 2, -1, -1, -1)])  # patchify repeats the last frame
    assert torch.equal(restored, padded)
    with pytest.raises(ValueError, match="do not match grid"):
        image_io.unpatchify(rows, (grid[0], grid_h, grid_w + 2), 14, 2, 2)


def test_denormalize_recovers_uint8():
    pixels = torch.randint(0, 256, (2, 3, 28, 42), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    config = MediaConfig()
    normalised = image_io.normalize(pixels, config.image_mean, config.image_std, config.rescale_factor)
    assert torch.equal(image_io.denormalize(normalised, config.image_mean, config.image_std, config.rescale_factor),
                       pixels)


@pytest.fixture(scope="module")
def odd_image_item(tmp_path_factory):
    """A ShadowLoader image item made from a 97x61 file (an odd size smart_resize changes)."""
    path = tmp_path_factory.mktemp("vllm_media") / "odd.png"
    rng = np.random.default_rng(3)
    Image.fromarray(rng.integers(0, 256, (61, 97, 3), dtype=np.uint8)).save(path)
    config = MediaConfig(image_min_pixels=28 * 28 * 4, image_max_pixels=28 * 28 * 64)
    meta, outputs = SamplePreprocessor(config).process(Record("odd", "<image>q", (MediaItem("image", str(path)),)))
    grid = tuple(int(v) for v in outputs["image_grid_thw"][0])
    return path, config, VisionItem("image", outputs["pixel_values"], grid)


def test_image_through_hf_processor_gives_shadowloader_pixels(odd_image_item):
    """What vLLM runs (transformers' processor with `processor_kwargs`) on `item_media` reproduces the
    ShadowLoader's grid and pixel rows."""
    hf_module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    _, config, item = odd_image_item
    geometry = PixelGeometry.from_media_config(config)
    image = item_media(item, geometry)
    assert image.dtype == np.uint8 and image.shape == (item.grid_thw[1] * 14, item.grid_thw[2] * 14, 3)
    processor = hf_module.Qwen2VLImageProcessorPil(image_mean=config.image_mean, image_std=config.image_std,
                                                   patch_size=14, merge_size=2, temporal_patch_size=2)
    kwargs = processor_kwargs([item], geometry)
    out = processor(images=[Image.fromarray(image)], size=kwargs["size"], return_tensors="pt")
    assert tuple(out["image_grid_thw"][0].tolist()) == item.grid_thw
    difference = (out["pixel_values"].float() - item.pixel_values.float()).abs().max().item()
    assert difference < 1e-5, f"pixel rows differ by {difference}"


def test_video_metadata_gives_shadowloader_timing():
    """transformers computes second_per_grid_ts = temporal_patch_size / VideoMetadata.sampled_fps."""
    from transformers.video_utils import VideoMetadata

    for seconds in (1.0, 0.5, 4 / 3):
        item = VisionItem("video", torch.zeros(3 * 4 * 6, 3 * 2 * 14 * 14), (3, 4, 6), seconds)
        metadata = VideoMetadata(**video_metadata(item, GEOMETRY))
        assert metadata.total_num_frames == 6
        assert 2 / metadata.sampled_fps == pytest.approx(seconds)


def test_processor_kwargs_bound_every_item():
    items = [VisionItem("image", torch.zeros(24, 1176), (1, 4, 6)), VisionItem("image", torch.zeros(64, 1176), (1, 8, 8)),
             VisionItem("video", torch.zeros(32, 1176), (2, 4, 4), 0.5)]
    kwargs = processor_kwargs(items, GEOMETRY)
    assert kwargs["size"] == {"shortest_edge": 16 * 196, "longest_edge": 64 * 196}
    assert kwargs["do_sample_frames"] is False and len(kwargs["video_metadata"]) == 1
    assert "cap_pixels_per_frame" not in kwargs
    assert processor_kwargs(items, PixelGeometry(pin_frame_cap=True))["cap_pixels_per_frame"] is False
    assert "cap_pixels_per_frame" not in processor_kwargs(items[:2], PixelGeometry(pin_frame_cap=True))
    assert processor_kwargs([], GEOMETRY) == {}


def request_with(items, prompt_ids, key="s0p0k0", seed=5):
    return RolloutRequest(key, prompt_ids, items, seed)


def test_collapse_vision_pads_and_build_prompt():
    image = VisionItem("image", torch.zeros(24, 1176), (1, 4, 6))  # 6 merged tokens
    video = VisionItem("video", torch.zeros(32, 1176), (2, 4, 4), 0.5)  # 8 merged tokens
    prompt = [1, 2, 7, 7, 7, 7, 7, 7, 3, 8, 8, 8, 8, 8, 8, 8, 8, 4]
    request = request_with([image, video], prompt)
    assert collapse_vision_pads(request, TOKENS, 2) == [1, 2, 7, 3, 8, 4]
    built = build_prompt(request, TOKENS, GEOMETRY)
    assert built["prompt_token_ids"] == [1, 2, 7, 3, 8, 4]
    assert built["multi_modal_data"]["image"][0].shape == (56, 84, 3)
    assert built["multi_modal_data"]["video"][0].shape == (4, 56, 56, 3)
    text = request_with([], [1, 2, 3])
    assert build_prompt(text, TOKENS, GEOMETRY) == {"prompt_token_ids": [1, 2, 3]}


@pytest.mark.parametrize("prompt,reason", [
    ([1, 7, 7, 7, 7, 7, 3], "do not match"),            # 5 pads for a 6-token image
    ([1, 7, 7, 7, 7, 7, 7, 3, 7], "do not match"),      # a pad run with no item
    ([1, 8, 8, 8, 8, 8, 8, 3], "do not match"),         # a video run where the image is
])
def test_collapse_vision_pads_rejects_mismatch(prompt, reason):
    image = VisionItem("image", torch.zeros(24, 1176), (1, 4, 6))
    with pytest.raises(ValueError, match=reason) as error:
        collapse_vision_pads(request_with([image], prompt, key="s1p2k3"), TOKENS, 2)
    assert "s1p2k3" in str(error.value)


def test_check_expanded_prompt():
    request = request_with([], [1, 7, 7, 3])
    check_expanded_prompt(request, [1, 7, 7, 3])
    with pytest.raises(ValueError, match="other vision grids.*|first difference at position 3"):
        check_expanded_prompt(request, [1, 7, 7, 7, 3])


def test_sampling_kwargs():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=12, eos_token_ids=(2, 5),
                            suppressed_token_ids=(7, 8))
    kwargs = sampling_kwargs(params, seed=2**62)
    assert kwargs["seed"] == 2**62 and kwargs["max_tokens"] == 12 and kwargs["stop_token_ids"] == [2, 5]
    assert kwargs["ignore_eos"] and kwargs["logprobs"] == 0 and kwargs["top_k"] == 0
    assert kwargs["logit_bias"] == {7: LOGIT_BIAS_FLOOR, 8: LOGIT_BIAS_FLOOR}
    assert "logit_bias" not in sampling_kwargs(SamplingParams(), seed=0)
    assert sampling_kwargs(SamplingParams(), seed=None)["seed"] is None


class FakeLogprob:
    def __init__(self, value):
        self.logprob = value


def test_logprobs_are_taken_at_the_run_temperature():
    """vllm engines get the run's sampling temperature (1 for greedy runs) for their log-probs: raw
    ones at 1, processed ones (after temperature) otherwise, and then refuse requests at another one."""
    for temperature, expected in ((1.0, 1.0), (0.7, 0.7), (0.0, 1.0)):
        options = RolloutConfig(backend="vllm", temperature=temperature).engine_options(colocated=True)
        assert options["logprob_temperature"] == expected
    assert "logprob_temperature" not in RolloutConfig(backend="hf", temperature=0.7).engine_options(colocated=True)
    assert logprobs_mode(1.0) == "raw_logprobs" and logprobs_mode(0.7) == "processed_logprobs"
    with pytest.raises(ValueError, match="logprob_temperature: must be > 0"):
        logprobs_mode(0.0)
    check_request_temperature(SamplingParams(temperature=0.7), 0.7)
    for any_temperature in (0.0, 0.7, 1.0):  # raw log-probs: the same whatever the request samples at
        check_request_temperature(SamplingParams(temperature=any_temperature), 1.0)
    with pytest.raises(ValueError, match="log-probs at temperature 0.7 .* asked to sample at 1.0"):
        check_request_temperature(SamplingParams(temperature=1.0), 0.7)


def test_the_logprob_diff_caveat_names_runs_where_vllm_filters_before_its_logprobs():
    """Only a vllm run at a temperature other than 0 and 1 with top-k or top-p on gets processed
    log-probs after the filter (logprobs_mode), so only there is rollout_logprob_diff no weight check."""
    caveat = RolloutConfig(backend="vllm", temperature=0.7, top_p=0.9).logprob_diff_caveat()
    assert caveat and "temperature 0.7" in caveat and "top_p 0.9" in caveat
    assert RolloutConfig(backend="vllm", temperature=0.7, top_k=20).logprob_diff_caveat()
    for quiet in (RolloutConfig(backend="vllm", temperature=1.0, top_p=0.9),   # raw log-probs
                  RolloutConfig(backend="vllm", temperature=0.7),               # no filter
                  RolloutConfig(backend="hf", temperature=0.7, top_k=20)):      # hf: before the filter
        assert quiet.logprob_diff_caveat() is None


def test_to_result():
    params = SamplingParams(eos_token_ids=(2,))
    logprobs = [{4: FakeLogprob(-0.5)}, {2: FakeLogprob(-1.0)}, {9: FakeLogprob(-2.0)}]
    stopped = to_result("k", [4, 2, 9], logprobs, params)
    assert (stopped.response_ids, stopped.logprobs, stopped.finish_reason) == ([4, 2], [-0.5, -1.0], "stop")
    cut = to_result("k", [4, 9], [logprobs[0], logprobs[2]], params)
    assert cut.finish_reason == "length" and cut.logprobs == [-0.5, -2.0]
    with pytest.raises(ValueError, match="log-probs for 2 tokens"):
        to_result("k", [4, 9], None, params)
    with pytest.raises(ValueError, match="no log-prob for sampled token 9"):
        to_result("k", [4, 9], [logprobs[0], {1: FakeLogprob(0.0)}], params)


def test_weight_names_land_where_the_checkpoint_names_do(tmp_path):
    """The names a sync sends (the HF model's in-memory parameters) reach the same vLLM modules as the
    checkpoint names `save_pretrained` writes (which vLLM loads at start): one to one."""
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model
    from flexrl_ds.models.weights import iter_weight_buckets

    model_dir = make_tiny_model(TinyModelConfig(out_dir=str(tmp_path / "vl")))
    model = load_model(str(model_dir))
    sent = [name for bucket in iter_weight_buckets(model, 1 << 16) for name, _ in bucket]
    from safetensors import safe_open

    saved = set()
    for file in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(file), "pt") as handle:
            saved.update(handle.keys())
    assert len(sent) == len(set(sent)) == len(saved)
    mapped = {vllm_weight_name(name) for name in sent}
    assert mapped == {vllm_weight_name(name) for name in saved}
    assert any(name.startswith("visual.") for name in mapped)
    with pytest.raises(ValueError, match="no vLLM Qwen2.5-VL module"):
        vllm_weight_name("encoder.layer.0.weight")


def test_engine_options_by_backend():
    assert RolloutConfig(backend="hf").engine_options(colocated=False) == \
        {"kv_cache": "dynamic", "sleep_level": 2, "load_weights_at_start": True}
    static_level_1 = RolloutConfig(backend="hf", hf=HFOptions(kv_cache="static", sleep_level=1))
    assert static_level_1.engine_options(colocated=True) == \
        {"kv_cache": "static", "sleep_level": 1, "load_weights_at_start": True}
    with pytest.raises(ValueError, match=re.escape("flexrl.rollout.hf.kv_cache: dynamic | static, got 'paged'")):
        HFOptions(kv_cache="paged")
    with pytest.raises(ValueError, match=re.escape("flexrl.rollout.hf.sleep_level: 1 or 2, got 0")):
        HFOptions(sleep_level=0)
    options = RolloutConfig(backend="vllm", vllm=VLLMOptions(gpu_memory_utilization=0.5)).engine_options(colocated=True)
    assert options["gpu_memory_utilization"] == 0.5 and options["sleep_level"] == 1
    for bad, match in (({"gpu_memory_utilization": 0}, "gpu_memory_utilization"),
                       ({"sleep_level": 3}, re.escape("flexrl.rollout.vllm.sleep_level: 1 or 2, got 3")),
                       ({"load_format": "pt"}, "load_format"), ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
                       ({"seeding": True}, "seeding")):
        with pytest.raises(ValueError, match=match):
            VLLMOptions(**bad)


def test_engines_that_start_without_the_policy_weights_are_synced_first():
    """Random weights, or weights dropped by a colocated engine's first sleep at level 2 (a 7B GPU run
    rolled out step 0 on those: log-prob difference 1.1 against 0.2 after the first sync)."""
    def needs(colocated, **vllm):
        return RolloutConfig(backend="vllm", vllm=VLLMOptions(**vllm)).engines_start_without_policy_weights(colocated)

    assert not needs(True) and not needs(False)
    assert needs(True, load_format="dummy") and needs(False, load_format="dummy")
    assert needs(True, sleep_level=2) and not needs(False, sleep_level=2)
    assert not RolloutConfig(backend="hf", hf=HFOptions(sleep_level=1)).engines_start_without_policy_weights(True)
    hf_dropping = RolloutConfig(backend="hf")  # sleep_level 2 by default
    assert hf_dropping.engines_start_without_policy_weights(True)
    assert not hf_dropping.engines_start_without_policy_weights(False)  # separate engines do not sleep


def test_engines_that_free_their_weights_at_once_start_without_reading_them():
    """Only colocated engines at sleep_level 2 free their weights at their first sleep, right after
    they start: they start without reading the model directory's (hf: load_weights_at_start False;
    vllm: load_format "dummy" in place of "auto", an explicit "safetensors" kept), and the trainer
    syncs every weight before step 0 for them. Every other case starts as before."""
    def vllm_format(colocated, **vllm):
        config = RolloutConfig(backend="vllm", vllm=VLLMOptions(**vllm))
        return config.engine_options(colocated=colocated)["load_format"]

    assert vllm_format(True, sleep_level=2) == "dummy"
    assert vllm_format(True, sleep_level=2, load_format="dummy") == "dummy"
    assert vllm_format(True, sleep_level=2, load_format="safetensors") == "safetensors"
    assert vllm_format(True, sleep_level=1) == "auto" and vllm_format(True) == "auto"  # level 1 is vllm's default
    assert vllm_format(False, sleep_level=2) == "auto" and vllm_format(False, sleep_level=1) == "auto"
    assert vllm_format(False, sleep_level=2, load_format="dummy") == "dummy"

    def hf_loads(colocated, **hf):
        options = RolloutConfig(backend="hf", hf=HFOptions(**hf)).engine_options(colocated=colocated)
        return options["load_weights_at_start"]

    assert not hf_loads(True) and not hf_loads(True, sleep_level=2)  # level 2 is hf's default
    assert hf_loads(True, sleep_level=1)
    assert hf_loads(False) and hf_loads(False, sleep_level=1)

    for backend in ("hf", "vllm"):  # an engine started without the directory's weights is always synced first
        for colocated in (True, False):
            for sleep_level in (1, 2):
                for load_format in ("auto", "dummy", "safetensors"):
                    config = RolloutConfig(backend=backend, hf=HFOptions(sleep_level=sleep_level),
                                           vllm=VLLMOptions(sleep_level=sleep_level, load_format=load_format))
                    options = config.engine_options(colocated=colocated)
                    skipped = not options.get("load_weights_at_start", True) or options.get("load_format") == "dummy"
                    assert not skipped or config.engines_start_without_policy_weights(colocated), \
                        (backend, colocated, sleep_level, load_format)


def test_every_hf_option_reaches_the_engine():
    """Each key of the hf backend's engine_options() is a keyword of HFRolloutEngine (splatted into it)."""
    import inspect

    from flexrl_ds.rollout.hf_engine import HFRolloutEngine

    keywords = set(inspect.signature(HFRolloutEngine.__init__).parameters)
    for colocated in (True, False):
        for sleep_level in (1, 2):
            config = RolloutConfig(backend="hf", hf=HFOptions(sleep_level=sleep_level))
            options = config.engine_options(colocated=colocated)
            assert set(options) <= keywords, set(options) - keywords


def test_vllm_config_section_reads_from_json():
    from flexrl_ds.common.typed import from_dict

    config = from_dict(RolloutConfig, json.loads('{"backend": "vllm", "vllm": {"sleep_level": 2}}'), "flexrl.rollout")
    assert config.vllm.sleep_level == 2


def test_every_vllm_option_reaches_the_engine():
    """Each `flexrl.rollout.vllm` field is a keyword of VLLMEngine (engine_options() is splatted into it),
    and the engine takes no option the config cannot set. Read from the source: vLLM is not here."""
    import ast
    import dataclasses

    source = Path(__file__).resolve().parents[3] / "flexrl_ds" / "rollout" / "vllm_engine.py"
    engine = next(node for node in ast.walk(ast.parse(source.read_text()))
                  if isinstance(node, ast.ClassDef) and node.name == "VLLMEngine")
    init = next(node for node in engine.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    common = {"self", "model_dir", "dtype", "device", "max_batch_sequences"}
    keywords = {arg.arg for arg in init.args.args + init.args.kwonlyargs} - common
    # logprob_temperature: the run's flexrl.rollout.temperature (test_logprobs_are_taken_at_the_run_temperature)
    assert keywords == {f.name for f in dataclasses.fields(VLLMOptions)} | {"logprob_temperature"}
    for colocated in (True, False):
        for sleep_level in (1, 2):
            config = RolloutConfig(backend="vllm", vllm=VLLMOptions(sleep_level=sleep_level))
            assert set(config.engine_options(colocated=colocated)) == keywords
