"""The vllm rollout backend on a GPU (issue 10): grids, pixels, weight sync, sleep/wake.

A small random Qwen2.5-VL (head_dim 64, so vLLM's attention kernels take it) and ShadowLoader items
made from generated images and videos of odd sizes (SamplePreprocessor, the OpenCV decoder there):
(a) vLLM's own processing (transformers' processor, called with `processor_kwargs`) of the engine's
    inputs gives the ShadowLoader's grids, second_per_grid_ts and pixel rows (the difference is printed);
(b) through the engine, vLLM's expansion of every prompt equals the trainer's token ids (the engine
    raises otherwise) and the responses are the requested length;
(c) after `load_weights` of another model's weights the engine's log-probs match that model's HF
    forward on the same tokens (with our pixels and mRoPE positions), far closer than the old
    weights do, for every prompt (a long video's positions included);
(d) sleep frees GPU memory and wake brings the engine back;
(e) vLLM's own input processor (the engine's, with its processor cache) gives, per item, the
    ShadowLoader's grid, pixels and second_per_grid_t, and places each item's vision tokens exactly
    where the trainer's prompt has its pad run;
(f) a separate engine's worker joins a weight channel and loads what the sender broadcasts;
(g) with the sender a process of its own on the same GPU, the channel shares each bucket in place
    (CUDA IPC) and the engine's worker loads from the sender's memory.
Skipped without CUDA or vLLM. Run by tests/gpu/run_vllm_on_gpu_machine.sh.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

vllm = pytest.importorskip("vllm")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

SMALL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             intermediate_size=512, vision_hidden_size=128, vision_depth=2, vision_num_heads=2,
             min_pixels=4 * 28 * 28, max_pixels=96 * 28 * 28)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from PIL import Image

    from flexrl_ds.bench.datasets import write_video
    from flexrl_ds.media.config import MediaConfig
    from flexrl_ds.media.preprocess import SamplePreprocessor
    from flexrl_ds.media.types import MediaItem, Record
    from flexrl_ds.models.processing import SampleEncoder
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("vllm_gpu")
    model_a = str(make_tiny_model(TinyModelConfig(out_dir=str(root / "a"), seed=1, **SMALL)))
    model_b = str(make_tiny_model(TinyModelConfig(out_dir=str(root / "b"), seed=2, **SMALL)))
    rng = np.random.default_rng(0)
    paths = []
    for index, (width, height) in enumerate(((97, 61), (203, 150), (333, 97))):
        paths.append(root / f"img{index}.png")
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(paths[-1])
    write_video(root / "vid0.mp4", num_frames=9, width=150, height=94, fps=4.0, seed=1)
    write_video(root / "vid1.mp4", num_frames=12, width=62, height=118, fps=6.0, seed=2)
    # 10 temporal groups of 2x2 merged patches: its temporal positions (0, 2, .., 18) reach far past
    # its spatial ones, where transformers 5.x's own rope index differs from the released rule
    write_video(root / "vid2.mp4", num_frames=40, width=62, height=62, fps=4.0, seed=3)
    preprocessor = SamplePreprocessor(MediaConfig().with_processor_dir(model_a))
    encoder = SampleEncoder(model_a)
    prompts = {}
    for key, files in {"img": paths[:1], "two": paths[1:], "vid": [root / "vid0.mp4"],
                       "mix": [paths[0], root / "vid1.mp4"], "long": [root / "vid2.mp4"]}.items():
        items = tuple(MediaItem("video" if f.suffix == ".mp4" else "image", str(f)) for f in files)
        markers = "".join("<video>" if i.kind == "video" else "<image>" for i in items)
        meta, outputs = preprocessor.process(Record(key, markers + "describe", items))
        vision = _vision_items(meta, outputs)
        prompts[key] = (encoder.encode_prompt(key, markers + "describe", vision), vision)
    return {"a": model_a, "b": model_b, "prompts": prompts}


def _vision_items(meta, outputs):
    from flexrl_ds.models.processing import VisionItem

    items, cursor = [], {"image": 0, "video": 0}
    rows = {"image": 0, "video": 0}
    for item in meta.items:
        kind = "video" if item.kind == "video" else "image"
        grid_key, pixel_key = f"{kind}_grid_thw", ("pixel_values_videos" if kind == "video" else "pixel_values")
        grid = tuple(int(v) for v in outputs[grid_key][cursor[kind]])
        count = grid[0] * grid[1] * grid[2]
        pixels = outputs[pixel_key][rows[kind]:rows[kind] + count]
        seconds = outputs["second_per_grid_ts"][cursor[kind]] if kind == "video" else 1.0
        items.append(VisionItem(kind, pixels, grid, float(seconds), share_key=f"{meta.id}/{len(items)}"))
        cursor[kind] += 1
        rows[kind] += count
    return items


def test_vllm_processing_matches_shadowloader(assets):
    """(a) transformers' processor (what vLLM calls) on the engine's inputs = ShadowLoader's tensors."""
    import transformers

    from flexrl_ds.media.config import MediaConfig
    from flexrl_ds.rollout.vllm_inputs import PixelGeometry, item_media, processor_kwargs

    processor = transformers.AutoProcessor.from_pretrained(assets["a"])
    geometry = PixelGeometry.from_media_config(MediaConfig().with_processor_dir(assets["a"]))
    worst = {"image": 0.0, "video": 0.0}
    for key, (_, items) in assets["prompts"].items():
        for item in items:
            media = item_media(item, geometry)
            kwargs = processor_kwargs([item], geometry)
            if item.kind == "image":
                out = processor.image_processor(images=[media], size=kwargs["size"], return_tensors="pt")
                grid, pixels = out["image_grid_thw"][0], out["pixel_values"]
            else:
                out = processor(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[media],
                                return_tensors="pt", **kwargs)
                grid, pixels = out["video_grid_thw"][0], out["pixel_values_videos"]
                assert float(out["second_per_grid_ts"][0]) == pytest.approx(item.second_per_grid_t), key
            assert tuple(grid.tolist()) == tuple(item.grid_thw), key
            worst[item.kind] = max(worst[item.kind], (pixels.float() - item.pixel_values.float()).abs().max().item())
    print(f"\nmax |vLLM processing - ShadowLoader| pixel difference (normalised units): {worst}")
    assert max(worst.values()) < 1e-3


@pytest.fixture(scope="module")
def engine(assets):
    from flexrl_ds.rollout.vllm_engine import VLLMEngine

    return VLLMEngine(assets["a"], dtype="float32", device="cuda:0", max_batch_sequences=16,
                      gpu_memory_utilization=0.2, enforce_eager=True)


def _requests(assets, seeds=(0, 1)):
    from flexrl_ds.rollout.base import RolloutRequest

    return [RolloutRequest(f"{key}/{seed}", list(ids), list(items), seed)
            for key, (ids, items) in assets["prompts"].items() for seed in seeds]


def test_engine_generates_with_shadowloader_grids(engine, assets):
    """(b) every prompt's vLLM expansion equals the trainer's (checked inside generate), seeded samples."""
    from flexrl_ds.rollout.base import SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    requests = _requests(assets)
    first = engine.generate(requests, params)
    again = engine.generate(list(reversed(requests)), params)
    assert [r.sample_key for r in first] == [r.sample_key for r in requests]
    assert all(len(r.response_ids) == 8 and r.finish_reason == "length" for r in first)
    assert {r.sample_key: r.response_ids for r in first} == {r.sample_key: r.response_ids for r in again}


def _hf_logprobs(model_dir, requests, results, temperature: float = 1.0):
    from flexrl_ds.models.flex_model import reference_logprobs
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.models.processing import EncodedSample

    model = load_model(model_dir).cuda()
    with torch.no_grad():
        return [reference_logprobs(model, EncodedSample(request.sample_key,
                                                        torch.tensor(request.prompt_ids + result.response_ids),
                                                        len(request.prompt_ids), list(request.items)),
                                   temperature).cpu()
                for request, result in zip(requests, results)]


def test_weight_sync_then_logprobs_match_new_weights(engine, assets):
    """(c) the engine generates with the weights last loaded."""
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.models.weights import iter_weight_buckets
    from flexrl_ds.rollout.base import SamplingParams

    policy_b = load_model(assets["b"]).cuda()
    engine.sleep()
    for bucket in iter_weight_buckets(policy_b, 1 << 20, "cuda"):
        engine.load_weights(bucket)
    engine.wake()
    requests = _requests(assets, seeds=(3,))
    results = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=8))
    engine_values = [torch.tensor(r.logprobs) for r in results]
    per_request_b = [(a - b).abs() for a, b in zip(engine_values, _hf_logprobs(assets["b"], requests, results))]
    diff_b = torch.cat(per_request_b)
    diff_a = torch.cat([(a - b).abs() for a, b in zip(engine_values, _hf_logprobs(assets["a"], requests, results))])
    worst = max(zip((float(d.mean()) for d in per_request_b), (r.sample_key for r in requests)))
    print(f"\nmean |vLLM - HF| log-prob after syncing model b: {diff_b.mean():.2e} against b, {diff_a.mean():.2e} "
          f"against the engine's original weights a; worst prompt {worst[1]} {worst[0]:.2e}")
    assert diff_b.mean() < 1e-2 and diff_b.mean() * 10 < diff_a.mean()
    assert worst[0] < 1e-2  # every prompt, the long video's mRoPE positions included


def test_sleep_frees_memory(engine, assets):
    """(d) sleep returns the engine's KV cache and weights to the device, wake brings them back."""
    from flexrl_ds.rollout.base import SamplingParams

    torch.cuda.synchronize()
    free_awake, _ = torch.cuda.mem_get_info()
    engine.sleep()
    free_asleep, _ = torch.cuda.mem_get_info()
    engine.wake()
    print(f"\nsleep freed {(free_asleep - free_awake) / 2**30:.1f} GiB")
    assert free_asleep - free_awake > 1 * 2**30
    assert len(engine.generate(_requests(assets, seeds=(0,))[:1], SamplingParams(max_new_tokens=4))[0].response_ids) == 4


def _pad_runs(prompt_ids, token_ids):
    """(start, length) of every run of vision pad tokens in a prompt."""
    runs, start = [], None
    for index, token in enumerate(list(prompt_ids) + [None]):
        if token in token_ids and start is None:
            start = index
        elif token not in token_ids and start is not None:
            runs.append((start, index - start))
            start = None
    return runs


def test_vllm_input_processor_places_shadowloader_grids(engine, assets):
    """(e) the items vLLM's own processing hands its encoder: grids, pixels, timing and token positions."""
    from flexrl_ds.rollout.vllm_inputs import build_prompt

    processor = engine.llm.llm_engine.input_processor
    tasks = engine.llm.llm_engine.get_supported_tasks()
    worst = 0.0
    try:
        for request in _requests(assets, seeds=(0,)):
            engine.reset_caches()  # items are cached by content (img and mix share an image): process each anew
            prompt = build_prompt(request, engine.tokens, engine.geometry)
            core = processor.process_inputs(f"probe-{request.sample_key}", prompt, vllm.SamplingParams(max_tokens=1),
                                            supported_tasks=tasks)
            assert list(core.prompt_token_ids) == list(request.prompt_ids), request.sample_key
            runs = _pad_runs(request.prompt_ids, {engine.tokens.image, engine.tokens.video})
            features = sorted(core.mm_features, key=lambda feature: feature.mm_position.offset)
            assert len(features) == len(request.items) == len(runs), request.sample_key
            for feature, item, run in zip(features, request.items, runs):
                assert feature.data is not None, f"{request.sample_key}: item served from vLLM's cache, not processed"
                data = feature.data.get_data()
                kind = "video" if item.kind == "video" else "image"
                assert feature.modality == kind
                assert tuple(int(v) for v in data[f"{kind}_grid_thw"].reshape(-1)) == tuple(item.grid_thw)
                pixels = data["pixel_values_videos" if kind == "video" else "pixel_values"]
                worst = max(worst, (pixels.float().cpu() - item.pixel_values.float()).abs().max().item())
                if kind == "video":
                    assert float(data["second_per_grid_ts"]) == pytest.approx(item.second_per_grid_t)
                assert (feature.mm_position.offset, feature.mm_position.length) == run, request.sample_key
    finally:
        engine.reset_caches()  # the probes filled the sender's media cache only: forget them on both sides
    print(f"\nvLLM input processor vs ShadowLoader: grids and token positions identical, max pixel difference {worst:.2e}")
    assert worst < 1e-3



def sync_over_weight_channel(engine, model) -> tuple[int, int]:
    """Send `model`'s weights (CPU buckets) to the engine's workers over a weight channel through host
    memory (gloo), the sender a thread of this process as policy rank 0 (CUDA IPC needs a sender
    process of its own: (g)); (tensors loaded, bytes sent)."""
    import threading

    from flexrl_ds.models.weights import iter_weight_buckets
    from flexrl_ds.runtime.weight_channel import ChannelAddress, WeightChannel
    from flexrl_ds.runtime.worker_group import open_store

    size = 1 + engine.channel_ranks
    store = open_store("127.0.0.1", size, 120.0)
    address = ChannelAddress("127.0.0.1", store.port, size, timeout_s=120.0)
    sent: dict[str, object] = {}

    def sender() -> None:
        try:
            sent["bytes"] = WeightChannel(address, 0, store).send(iter_weight_buckets(model, 1 << 20, "cpu"))
        except Exception as error:  # reported by the assertion below, not lost in the thread
            sent["error"] = error

    thread = threading.Thread(target=sender)
    thread.start()
    engine.join_weight_channel(address, 1)
    loaded = engine.receive_weights()
    thread.join(timeout=120)
    engine.reset_caches()
    assert not thread.is_alive() and "error" not in sent, sent.get("error")
    assert loaded > 0 and int(sent["bytes"]) > 0
    return loaded, int(sent["bytes"])


def logprob_gaps(engine, assets, seed: int) -> dict[str, float]:
    """Mean |vLLM - HF| log-prob of the engine's samples against models a and b."""
    from flexrl_ds.rollout.base import SamplingParams

    requests = _requests(assets, seeds=(seed,))
    results = engine.generate(requests, SamplingParams(temperature=1.0, max_new_tokens=8))
    values = [torch.tensor(r.logprobs) for r in results]
    return {name: float(torch.cat([(v - h).abs() for v, h in zip(values, _hf_logprobs(assets[name], requests, results))]).mean())
            for name in ("a", "b")}


def test_separate_engine_workers_receive_over_the_weight_channel(engine, assets):
    """(f) a separate engine's sync: its worker joins a weight channel (rollout/vllm_workers.py, over
    `collective_rpc`) and loads what the sender broadcasts: model a's weights ((c) left b's)."""
    from flexrl_ds.models.loading import load_model

    assert engine.channel_ranks == 1
    loaded, sent = sync_over_weight_channel(engine, load_model(assets["a"]))
    gaps = logprob_gaps(engine, assets, seed=4)
    print(f"\nover the weight channel ({loaded} tensors, {sent / 2**20:.1f} MiB): mean |vLLM - HF| "
          f"{gaps['a']:.2e} against the weights sent (a), {gaps['b']:.2e} against the previous (b)")
    assert gaps["a"] < 1e-2 and gaps["a"] * 10 < gaps["b"]


def _gpu_sender(model_dir: str, ports, results, gpu: int = 0, size: int = 2) -> None:
    """Policy rank 0 in a process of its own on GPU `gpu` (0: the engine's), in a channel of `size`
    ranks: sends the model's GPU buckets."""
    try:
        from flexrl_ds.bench.channel_bench import join_channel
        from flexrl_ds.models.loading import load_model
        from flexrl_ds.models.weights import iter_weight_buckets

        torch.cuda.set_device(gpu)
        model = load_model(model_dir).to(f"cuda:{gpu}")
        channel = join_channel(0, size, ports, use_gpu=True, timeout_s=120.0)  # hands the engine its port
        sent = channel.send(iter_weight_buckets(model, 1 << 20, f"cuda:{gpu}"))
        results.put((channel.transport, sent))
    except Exception:  # noqa: BLE001 - reported by the test
        import traceback

        results.put(("error", traceback.format_exc()))


def sync_from_gpu_sender(engine, model_dir, gpu: int = 0) -> tuple[int, str, int]:
    """Send `model_dir`'s weights from a policy-rank-0 process on GPU `gpu` (`_gpu_sender`) to the
    engine's workers over a weight channel that may use GPUs; (tensors loaded, transport agreed,
    bytes sent)."""
    import multiprocessing

    from flexrl_ds.runtime.weight_channel import ChannelAddress

    size = 1 + engine.channel_ranks
    context = multiprocessing.get_context("spawn")
    ports, results = context.Queue(), context.Queue()
    sender = context.Process(target=_gpu_sender, args=(str(model_dir), ports, results, gpu, size), daemon=True)
    sender.start()
    try:
        port = ports.get(timeout=180)
        for _ in range(size - 2):  # the sender hands its port once per receiver rank; the engine joins them all
            assert ports.get(timeout=10) == port
        engine.join_weight_channel(ChannelAddress("127.0.0.1", port, size, timeout_s=120.0, use_gpu=True), 1)
        loaded = engine.receive_weights()
        transport, sent = results.get(timeout=120)
    finally:
        sender.join(timeout=60)
        if sender.is_alive():
            sender.terminate()
    engine.reset_caches()
    return loaded, transport, sent


def test_separate_engine_sharing_the_gpu_receives_buckets_in_place(engine, assets):
    """(g) a separate engine on policy rank 0's GPU: the channel agrees on sharing each bucket in
    place (CUDA IPC) and the engine's worker loads model b's weights ((f) left a's) from the sender's memory."""
    from flexrl_ds.runtime.weight_channel import SAME_GPU

    loaded, transport, sent = sync_from_gpu_sender(engine, assets["b"])
    assert transport == SAME_GPU, sent
    gaps = logprob_gaps(engine, assets, seed=6)
    print(f"\nshared in place on one GPU ({loaded} tensors, {sent / 2**20:.1f} MiB): mean |vLLM - HF| "
          f"{gaps['b']:.2e} against the weights sent (b), {gaps['a']:.2e} against the previous (a)")
    assert loaded > 0 and gaps["b"] < 1e-2 and gaps["b"] * 10 < gaps["a"]
