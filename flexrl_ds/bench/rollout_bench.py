"""`flexrl bench rollout`: the trainer's rollout engines on the same prompts, and a colocated weight sync.

One process, one GPU: a model of a named shape (Qwen2.5-VL-7B/3B layers and their 151,936-row
vocabulary, models/vocabulary.py) is built with random bf16 weights on the GPU; the `hf` engine samples from that model
and the `vllm` engine from its own copy (`load_format="dummy"`), both through the trainer's
`RolloutEngine` interface on identical text prompts (random token ids) with EOS off, so every
response is exactly `new_tokens` long. vLLM is timed per seeding mode (per sample, none)
and bare (`LLM.generate` on the same token prompts). Every engine is timed `repeats` times after one
warm-up, each from cold caches; its best time gives its tokens/s (one 2 s timing moved by ~10%
between runs on a shared machine). The trainer's engines are then timed again, each timing after
the engine slept and woke (`<engine>_after_sleep`): between steps a colocated engine frees the
GPU for the update, so every step's rollout starts from what `wake` gives back. Then the HF
model's weights are synced into the vLLM engine in buckets as a colocated policy rank does
(`iter_weight_buckets` on the GPU -> `load_weights`), timed,
and the engine's log-probs of greedy samples are compared with the HF model's on the same tokens:
after the sync both hold the same weights.

Every engine is also set against the batch's roofline floor (bench/rollout_floor.py) on this GPU's
measured peaks (a bf16 GEMM, a device-to-device copy): its share of the floor, and the most any
engine could gain over hf (hf's time ÷ the floor).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from flexrl_ds.bench.rollout_floor import DecoderShape, Peaks, rollout_floor
from flexrl_ds.common.output_files import output_file
from flexrl_ds.models.flex_model import reference_logprobs
from flexrl_ds.models.loading import ordinary_token_bound
from flexrl_ds.models.processing import EncodedSample
from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model
from flexrl_ds.models.vocabulary import QWEN_VL_VOCAB_SIZE
from flexrl_ds.models.weights import iter_weight_buckets, tensor_bytes
from flexrl_ds.parallel import device as device_mod
from flexrl_ds.rollout.base import RolloutRequest, SamplingParams
from flexrl_ds.rollout.hf_options import KV_CACHE_MODES
from flexrl_ds.rollout.hf_engine import HFRolloutEngine

_QWEN3_VL_TEXT = dict(head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 5_000_000.0,
                                                     "mrope_section": [24, 20, 20], "mrope_interleaved": True})
"""Qwen3-VL's released text-config fields beyond the layer sizes (dense and MoE alike)."""
_QWEN3_VL_VISION = dict(intermediate_size=4304, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
                        hidden_act="gelu_pytorch_tanh")
"""Qwen3-VL's released vision tower (27 blocks of 1152, patch 16, DeepStack from blocks 8, 16 and 24)."""
QWEN3_VL_MOE_LAYERS = 12
"""Decoder layers of the reduced Qwen3-VL MoE shape (the release has 48)."""
SHAPES: dict[str, dict[str, Any]] = {
    "7b": dict(hidden_size=3584, num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28,
               intermediate_size=18944, vision_hidden_size=1280, vision_depth=32, vision_num_heads=16,
               vocab_size=QWEN_VL_VOCAB_SIZE),
    "3b": dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, num_hidden_layers=36,
               intermediate_size=11008, vision_hidden_size=1280, vision_depth=32, vision_num_heads=16,
               vocab_size=QWEN_VL_VOCAB_SIZE),
    "qwen3-vl-8b": dict(arch="qwen3-vl", hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                        num_hidden_layers=36, intermediate_size=12288, vision_hidden_size=1152, vision_depth=27,
                        vision_num_heads=16, vocab_size=QWEN_VL_VOCAB_SIZE, text_overrides=dict(_QWEN3_VL_TEXT),
                        vision_overrides=dict(_QWEN3_VL_VISION)),
    "qwen3-vl-moe": dict(arch="qwen3-vl-moe", hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                         num_hidden_layers=QWEN3_VL_MOE_LAYERS, intermediate_size=6144, vision_hidden_size=1152,
                         vision_depth=27, vision_num_heads=16, vocab_size=QWEN_VL_VOCAB_SIZE,
                         text_overrides=dict(_QWEN3_VL_TEXT, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                             moe_intermediate_size=768),
                         vision_overrides=dict(_QWEN3_VL_VISION)),
    "tiny": dict(),
}
"""Model shapes (TinyModelConfig fields): Qwen2.5-VL-7B and -3B decoder, vision tower and vocabulary
(151,936 rows; until 2026-12-05 the tiny tokenizer's 640); Qwen3-VL-8B's; and Qwen3-VL-30B-A3B's layers
(128 experts, 8 active, 48 layers in the release) at QWEN3_VL_MOE_LAYERS decoder layers, so that it
trains on one GPU."""

QWEN_VL_VISION: dict[str, Any] = dict(intermediate_size=3420, window_size=112, fullatt_block_indexes=[7, 15, 23, 31])
"""Qwen2.5-VL-3B's and -7B's released vision tower beyond its width, depth and heads (the same in both;
HF vision-config fields), in SHAPES since 2026-12-05; before, MLP 2560, 56 px windows and full attention
in the last block only: ~2.6x the released model's attention windows on the bench's media, each one call
from Python under transformers' sdpa (docs/notes/update-gap-hypotheses.md)."""
for _qwen25_vl in ("3b", "7b"):
    SHAPES[_qwen25_vl] = {**SHAPES[_qwen25_vl], "vision_overrides": dict(QWEN_VL_VISION)}


@dataclass
class RolloutBenchConfig:
    shape: str = "7b"
    prompts: int = 64
    prompt_len: int = 512
    new_tokens: int = 256
    backends: tuple[str, ...] = ("hf", "vllm")
    bucket_mb: int = 512
    gpu_memory_utilization: float = 0.4
    work_dir: str = "/tmp/flexrl-rollout-bench"
    seed: int = 0
    repeats: int = 3
    """Timings per engine (the best is its figure; all are kept)."""
    hf_kv_caches: tuple[str, ...] = ("dynamic", "static")
    """The hf engine's KV caches to time (`HFOptions.kv_cache`): "hf" is the dynamic one, "hf_static" the static."""

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"--shape: one of {', '.join(SHAPES)}, got {self.shape!r}")
        for name in ("prompts", "prompt_len", "new_tokens", "bucket_mb", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(self, name)}")
        if "hf" in self.backends and (not self.hf_kv_caches or set(self.hf_kv_caches) - set(KV_CACHE_MODES)
                                      or len(set(self.hf_kv_caches)) < len(self.hf_kv_caches)):
            raise ValueError(f"--hf-kv-caches: {' and/or '.join(KV_CACHE_MODES)}, each once, got "
                             f"{','.join(self.hf_kv_caches)}")
        unknown = set(self.backends) - {"hf", "vllm"}
        if unknown or not self.backends:
            raise ValueError(f"--backends: hf and/or vllm, got {','.join(self.backends)}")


@dataclass
class RolloutBenchResult:
    config: dict
    device: str
    tokens_per_s: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    """Per engine, its best time."""
    timings_s: dict[str, list[float]] = field(default_factory=dict)
    """Per engine, every timing."""
    sync_s: list[float] = field(default_factory=list)
    sync_tensors: int = 0
    sync_gib: float = 0.0
    logprob_diff_before_sync: float | None = None
    logprob_diff_after_sync: float | None = None
    logprob_diff_after_sync_by_case: dict[str, float] = field(default_factory=dict)
    """After the sync: greedy / sampled (temperature 1) tokens, prompt_len / 8 x prompt_len prompts."""
    engine_start_s: float | None = None
    vllm_async_scheduling: bool | None = None
    peak_tflops: float | None = None
    """bf16 GEMM TFLOP/s measured on the GPU (an 8192³ matmul)."""
    peak_gb_per_s: float | None = None
    """Device memory GB/s measured on the GPU (a 2 GiB device-to-device copy: read + write)."""
    floor_s: dict[str, float] = field(default_factory=dict)
    """The batch's roofline floor at those peaks: prefill, decode and total seconds (bench/rollout_floor.py)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def record(self, engine: str, timings_s: list[float], tokens: int) -> str:
        """Keep an engine's timings of `tokens` generated tokens; the line that reports them."""
        best = min(timings_s)
        self.timings_s[engine], self.seconds[engine], self.tokens_per_s[engine] = list(timings_s), best, tokens / best
        return (f"{tokens} tokens in {best:.2f} s = {tokens / best:,.0f} tokens/s "
                f"(best of {', '.join(f'{t:.2f}' for t in timings_s)} s)")


def _model_dir(config: RolloutBenchConfig) -> Path:
    shape = SHAPES[config.shape]  # a folder of an older build (tiny vocabulary, 56 px windows) is not reused
    vocab, window = shape.get("vocab_size"), shape.get("vision_overrides", {}).get("window_size")
    out = Path(config.work_dir) / (f"model-{config.shape}" + (f"-v{vocab}" if vocab else "")
                                   + (f"-vis{window}" if window else ""))
    if not (out / "config.json").is_file():
        make_tiny_model(TinyModelConfig(out_dir=str(out), **SHAPES[config.shape]), weights=False)  # type: ignore[arg-type]
    return out


def _hf_model(model_dir: Path, device: Any):
    hf_config = transformers.AutoConfig.from_pretrained(str(model_dir))
    torch.manual_seed(0)
    with torch.device(device):
        model = getattr(transformers, hf_config.architectures[0])._from_config(hf_config, dtype=torch.bfloat16)
    return model.eval()


def _requests(config: RolloutBenchConfig, hf_config: Any):
    """Random text prompts over the ordinary tokens (below the first special token: no vision pads)."""
    upper = ordinary_token_bound(hf_config)
    generator = torch.Generator().manual_seed(config.seed)
    ids = torch.randint(0, upper, (config.prompts, config.prompt_len), generator=generator)
    return [RolloutRequest(f"p{index}", ids[index].tolist(), [], seed=index) for index in range(config.prompts)]


def _timed_generate(engine, requests, params, repeats: int, after_sleep: bool = False) -> tuple[list[float], int]:
    """The trainer's `RolloutEngine.generate` on the requests: (seconds of each timing, tokens generated)."""
    return _timed_tokens(engine, requests, lambda chosen: sum(
        len(result.response_ids) for result in engine.generate(chosen, params)), repeats, after_sleep)


def _timed_tokens(engine, requests, generate, repeats: int, after_sleep: bool = False) -> tuple[list[float], int]:
    """`generate(requests) -> tokens` timed `repeats` times after a warm-up on two requests
    (kernels, allocator), each after a cache reset (no prefix computed before is reused);
    after_sleep: each also after the engine slept and woke, as between two training steps (the
    sleep and the wake are not timed here; the trainer's rollout phase holds them, `rollout_time_s`)."""
    info = device_mod.detect()
    generate(requests[:2])
    timings, tokens = [], 0
    for _ in range(repeats):
        if after_sleep:
            engine.sleep()
            engine.wake()
        engine.reset_caches()
        device_mod.synchronize(info)
        started = time.perf_counter()
        tokens = generate(requests)
        device_mod.synchronize(info)
        timings.append(time.perf_counter() - started)
    return timings, tokens


def run_rollout_bench(config: RolloutBenchConfig, progress=print) -> RolloutBenchResult:
    info = device_mod.detect()
    if not info.is_gpu:
        raise ValueError("flexrl bench rollout: needs a GPU (vLLM and the timed engines run there)")
    device = device_mod.set_local_device(info, 0)
    result = RolloutBenchResult(asdict(config), device_mod.accelerator_name() or "?")
    model_dir = _model_dir(config)
    model = _hf_model(model_dir, device)
    requests = _requests(config, model.config)
    params = SamplingParams(temperature=1.0, max_new_tokens=config.new_tokens)
    _record_floor(config, model, result, progress)
    if "hf" in config.backends:
        for kv_cache in config.hf_kv_caches:
            _bench_hf(config, model_dir, model, kv_cache, requests, params, result, progress)
    if "vllm" in config.backends:
        _bench_vllm(config, model_dir, model, requests, params, result, progress)
    return result


def measure_peaks(device: Any, repeats: int = 10) -> Peaks:
    """What this GPU reaches: bf16 FLOP/s of an 8192³ matmul and bytes/s of a 2 GiB copy (each the
    best of `repeats` after a warm-up; a copy reads and writes every byte)."""
    info = device_mod.detect()

    def best_seconds(work) -> float:
        work()
        times = []
        for _ in range(repeats):
            device_mod.synchronize(info)
            started = time.perf_counter()
            work()
            device_mod.synchronize(info)
            times.append(time.perf_counter() - started)
        return min(times)

    size = 8192
    left, right = (torch.randn(size, size, dtype=torch.bfloat16, device=device) for _ in range(2))
    flops = 2.0 * size**3 / best_seconds(lambda: left @ right)  # noqa: F821 - deleted below, after its use
    source = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    bytes_per_s = 2.0 * source.numel() / best_seconds(lambda: target.copy_(source))  # noqa: F821 - as above
    del left, right, source, target
    device_mod.release_cached_memory(info)  # the engines started after this see the memory free
    return Peaks(flops, bytes_per_s)


def _record_floor(config: RolloutBenchConfig, model, result: RolloutBenchResult, progress) -> None:
    """The batch's roofline floor on this GPU's measured peaks (bench/rollout_floor.py)."""
    peaks = measure_peaks(next(model.parameters()).device)
    shape = DecoderShape.from_config(model.config.get_text_config())
    floor = rollout_floor(shape, config.prompts, config.prompt_len, config.new_tokens, peaks)
    result.peak_tflops, result.peak_gb_per_s = peaks.flops_per_s / 1e12, peaks.bytes_per_s / 1e9
    result.floor_s = {"prefill": floor.prefill_s, "decode": floor.decode_s, "total": floor.seconds}
    progress(f"[bench rollout] roofline floor at this GPU's measured peaks ({result.peak_tflops:.0f} TFLOP/s bf16 "
             f"GEMM, {result.peak_gb_per_s:,.0f} GB/s copy): prefill {floor.prefill_s:.2f} s + decode "
             f"{floor.decode_s:.2f} s = {floor.seconds:.2f} s, {floor.tokens_per_s:,.0f} tokens/s")


def _bench_hf(config, model_dir, model, kv_cache, requests, params, result: RolloutBenchResult, progress) -> None:
    """HF `generate` with one KV cache mode, warm and after sleep and wake."""
    name = "hf" if kv_cache == "dynamic" else f"hf_{kv_cache}"
    engine = HFRolloutEngine(model_dir, dtype="bfloat16", device=next(model.parameters()).device,
                             max_batch_sequences=config.prompts, model=model, kv_cache=kv_cache,
                             sleep_level=1)  # the model is shared with the other measurements: kept over sleeps
    timings, tokens = _timed_generate(engine, requests, params, config.repeats)
    progress(f"[bench rollout] {name} generate ({kv_cache} KV cache): {result.record(name, timings, tokens)}")
    timings, tokens = _timed_generate(engine, requests, params, config.repeats, after_sleep=True)
    progress(f"[bench rollout] {name} generate, each after sleep and wake: "
             + result.record(f"{name}_after_sleep", timings, tokens))


def _bench_vllm(config, model_dir, model, requests, params, result: RolloutBenchResult, progress) -> None:
    from flexrl_ds.rollout.vllm_engine import VLLMEngine  # lazy: vllm is a GPU-only extra

    started = time.perf_counter()
    engine = VLLMEngine(model_dir, dtype="bfloat16", device=next(model.parameters()).device,
                        max_batch_sequences=config.prompts, load_format="dummy",
                        gpu_memory_utilization=config.gpu_memory_utilization)
    result.engine_start_s = time.perf_counter() - started
    result.vllm_async_scheduling = _async_scheduling(engine)
    timings, tokens = _timed_generate(engine, requests, params, config.repeats)
    line = result.record("vllm", timings, tokens)
    result.logprob_diff_before_sync = _logprob_diff(engine, model, requests[:4])
    progress(f"[bench rollout] vllm (started in {result.engine_start_s:.0f} s): {line}")
    timings, tokens = _timed_generate(engine, requests, params, config.repeats, after_sleep=True)
    progress(f"[bench rollout] vllm, each after sleep and wake: {result.record('vllm_after_sleep', timings, tokens)}")
    engine.seeding = "off"  # the same prompts with the seeds left to vLLM: what per-sample seeds cost
    try:
        timings, tokens = _timed_generate(engine, requests, params, config.repeats)
    finally:
        engine.seeding = "sample"
    progress(f"[bench rollout] vllm, seeding 'off': {result.record('vllm_seeding_off', timings, tokens)}")
    timings, tokens = _timed_raw_generate(engine, requests, config.new_tokens, config.repeats)
    progress("[bench rollout] bare vLLM (LLM.generate on token prompts, no seeds, no log-probs): "
             + result.record("vllm_raw", timings, tokens))
    for _ in range(3):
        _timed_sync(engine, model, config.bucket_mb << 20, result)
    progress(f"[bench rollout] colocated sync of {result.sync_tensors} tensors ({result.sync_gib:.1f} GiB): "
             + ", ".join(f"{s:.2f} s" for s in result.sync_s))
    result.logprob_diff_after_sync = _logprob_diff(engine, model, requests[:4])
    progress(f"[bench rollout] mean |vLLM - HF| log-prob of vLLM's greedy tokens: "
             f"{result.logprob_diff_before_sync:.4f} before the first sync (vLLM's own random weights), "
             f"{result.logprob_diff_after_sync:.4f} after")
    long_config = RolloutBenchConfig(**{**asdict(config), "prompts": 4, "prompt_len": 8 * config.prompt_len})
    cases = {"greedy": (requests[:4], 0.0), "sampled": (requests[:4], 1.0),
             "greedy_long": (_requests(long_config, model.config), 0.0)}
    for case, (chosen, temperature) in cases.items():
        result.logprob_diff_after_sync_by_case[case] = _logprob_diff(engine, model, chosen, temperature)
    progress("[bench rollout] after the sync, by case: " + ", ".join(
        f"{case} {value:.4f}" for case, value in result.logprob_diff_after_sync_by_case.items()))


def _async_scheduling(engine) -> bool | None:
    """Whether the engine's scheduler overlaps the next step's scheduling with this step's GPU work."""
    llm_engine = getattr(getattr(engine, "llm", None), "llm_engine", None)
    scheduler = getattr(getattr(llm_engine, "vllm_config", None), "scheduler_config", None)
    return getattr(scheduler, "async_scheduling", None)


def _timed_raw_generate(engine, requests, new_tokens: int, repeats: int) -> tuple[list[float], int]:
    """The engine's `vllm.LLM` called directly (`bare_generate`), as the bare-engine measurement did:
    what the trainer's engine adds on top (request building, seeds, log-probs, the prompt check) is
    the difference."""
    return _timed_tokens(engine, requests, lambda chosen: engine.bare_generate(
        [request.prompt_ids for request in chosen], new_tokens), repeats)


def _timed_sync(engine, model, bucket_bytes: int, result: RolloutBenchResult) -> None:
    info = device_mod.detect()
    device = next(model.parameters()).device
    engine.sleep()  # as between steps: the policy trained while the engine slept
    device_mod.synchronize(info)
    started = time.perf_counter()
    count = size = 0
    for bucket in iter_weight_buckets(model, bucket_bytes, device):
        engine.load_weights(bucket)
        count += len(bucket)
        size += sum(tensor_bytes(tensor) for _, tensor in bucket)
    engine.wake()
    device_mod.synchronize(info)
    result.sync_s.append(time.perf_counter() - started)
    result.sync_tensors, result.sync_gib = count, size / 2**30


def _logprob_diff(engine, model, requests, temperature: float = 0.0) -> float:
    """Mean |vLLM - HF| log-prob over vLLM's responses (greedy by default; bf16 both: ~1e-2 is
    agreement, a stale or missing weight gives O(1))."""
    results = engine.generate(requests, SamplingParams(temperature=temperature, max_new_tokens=16))
    diffs = []
    with torch.no_grad():
        for request, sampled in zip(requests, results):
            sample = EncodedSample(request.sample_key, torch.tensor(request.prompt_ids + sampled.response_ids),
                                   len(request.prompt_ids), list(request.items))
            ours = reference_logprobs(model, sample).cpu()
            diffs.append((ours - torch.tensor(sampled.logprobs)).abs())
    return float(torch.cat(diffs).mean())


def write_result(result: RolloutBenchResult, path: str | None) -> None:
    if path:
        output_file(path).write_text(json.dumps(result.to_json(), indent=1) + "\n")
