"""The `vllm` rollout backend: a vLLM engine in the calling process (GPU only; `pip install .[gpu]`).

The engine lives where `RolloutHost` puts it: inside a policy rank (`flexrl.trainer.colocate`) or in
a Ray actor of its own. It runs in process (vLLM's V1 multiprocessing off), so a colocated engine's
`load_weights` hands the gathered ZeRO-3 buckets straight to the model's `load_weights` on the same
GPU (no copy between processes), and `sleep` / `wake` use vLLM's sleep mode. A separate engine's
workers (one, or one per shard with `tensor_parallel_size` > 1) receive the buckets over the
weight channel themselves (`join_weight_channel` / `receive_weights`, rollout/vllm_workers.py).
In process costs no throughput: on one H200 the engine core in process and in a process of its own
made the same tokens/s (docs/notes/one-h200-runs-2026-12-01.md, "One H200, fourth run"). Inside a
process that already belongs to a torch.distributed world (a policy rank) vLLM joins that world
(`external_launcher`) instead of starting its own.

Requests become vLLM token prompts with the ShadowLoader's pixels (`vllm_inputs.py`); every result
is checked: vLLM's own vision expansion must give the trainer's prompt token for token, i.e. as many
vision tokens per item as the trainer's grids (a grid of the same size in another shape, or other
video timing, would pass this check; the GPU tests compare vLLM's grids and positions, and
`rollout_logprob_diff` would show it in a run). Seeding (`VLLMOptions.seeding`): "sample" gives
each request its sample's seed,
so its response depends on that seed, not on the batch; "off" leaves the seeds to vLLM (0.26's
model runner draws them from numpy's global generator). Log-probs are taken at the engine's
`logprob_temperature` (the run's sampling temperature: vllm_inputs.py `logprobs_mode`); the
trainer's `rollout_logprob_diff` compares them with its own.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import torch
import vllm

from flexrl_ds.media.config import MediaConfig
from flexrl_ds.rollout.base import RolloutRequest, RolloutResult, SamplingParams
from flexrl_ds.rollout.vllm_options import SEEDING_MODES
from flexrl_ds.rollout.vllm_inputs import (PixelGeometry, VisionTokens, build_prompt, check_expanded_prompt,
                                           check_request_temperature, logprobs_mode, sampling_kwargs, to_result,
                                           vllm_replaces_bare_video_pad)
from flexrl_ds.rollout.vllm_workers import EXTENSION as WORKER_EXTENSION
from flexrl_ds.rollout.vllm_workers import WeightReceiverExtension
from flexrl_ds.runtime.weight_channel import ChannelAddress


def _logprobs_kwargs(logprob_temperature: float) -> dict[str, str]:
    """`logprobs_mode` for `vllm.LLM`, left to vLLM where its default (raw log-probs) is the one asked."""
    mode = logprobs_mode(logprob_temperature)
    return {} if mode == "raw_logprobs" else {"logprobs_mode": mode}


class VLLMEngine:
    """One vLLM engine holding a full copy of the policy (see the module docstring)."""

    def __init__(self, model_dir: str | Path, dtype: str = "bfloat16", device: Any = None,
                 max_batch_sequences: int = 64, gpu_memory_utilization: float = 0.35,
                 tensor_parallel_size: int = 1, enforce_eager: bool = False, load_format: str = "auto",
                 max_model_len: int | None = None, sleep_level: int = 1, max_images_per_prompt: int = 4,
                 max_videos_per_prompt: int = 1, seeding: str = "sample", logprob_temperature: float = 1.0):
        if not (Path(model_dir) / "config.json").is_file():
            raise ValueError(f"model_dir: {model_dir} is not a model directory (no config.json)")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in process: load_weights reaches the model
        if seeding not in SEEDING_MODES:
            raise ValueError(f"seeding: {' | '.join(SEEDING_MODES)}, got {seeding!r}")
        self.sleep_level, self.seeding, self.logprob_temperature = sleep_level, seeding, logprob_temperature
        in_world = torch.distributed.is_available() and torch.distributed.is_initialized()
        if in_world and tensor_parallel_size > 1:
            raise ValueError("vLLM engine: tensor_parallel_size > 1 only for separate engines; inside a "
                             f"policy rank every engine holds the whole model (got {tensor_parallel_size})")
        self.tensor_parallel_size = tensor_parallel_size
        with _local_rank_of(device):
            self.llm = vllm.LLM(
                model=str(model_dir), dtype=dtype, tensor_parallel_size=tensor_parallel_size,
                gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                load_format=load_format, max_model_len=_max_model_len(max_model_len), max_num_seqs=max_batch_sequences,
                enable_sleep_mode=True, enable_prefix_caching=True, seed=0,
                **_logprobs_kwargs(logprob_temperature), **_moe_kwargs(Path(model_dir)),
                limit_mm_per_prompt={"image": max_images_per_prompt, "video": max_videos_per_prompt},
                # vLLM's processor cache serves items one by one but calls the processor with the
                # prompt's whole video_metadata list: with several videos a partial hit would fail.
                mm_processor_cache_gb=0 if max_videos_per_prompt > 1 else 4,
                distributed_executor_backend=_executor_backend(in_world, tensor_parallel_size),
                worker_extension_cls=WORKER_EXTENSION)
        config = self.llm.llm_engine.model_config.hf_config
        self.is_vision_language = getattr(config, "vision_config", None) is not None
        names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        self.tokens = VisionTokens(*(int(getattr(config, name, -1)) for name in names))
        media = MediaConfig().with_processor_dir(str(model_dir))
        self.geometry = PixelGeometry.from_media_config(
            media, pin_frame_cap=_processor_knows_frame_cap(),
            bare_video_pad=vllm_replaces_bare_video_pad(media.processor_family))
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self._asleep: set[str] = set()

    def generate(self, requests: Sequence[RolloutRequest], params: SamplingParams) -> list[RolloutResult]:
        """One result per request, in request order (see the module docstring)."""
        if self._asleep:
            raise RuntimeError("vLLM engine: generate while asleep (call wake first)")
        check_request_temperature(params, self.logprob_temperature)
        prompts = self._prompts(requests)
        per_sample = self.seeding == "sample"
        sampling = [vllm.SamplingParams(**sampling_kwargs(params, request.seed if per_sample else None))
                    for request in requests]
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        results = []
        for request, output in zip(requests, outputs):
            check_expanded_prompt(request, output.prompt_token_ids)
            completion = output.outputs[0]
            results.append(to_result(request.sample_key, completion.token_ids, completion.logprobs, params))
        return results

    def bare_generate(self, prompt_ids: Sequence[Sequence[int]], new_tokens: int) -> int:
        """Benchmarks only: vLLM's `LLM.generate` on plain token prompts at temperature 1 with EOS off
        (no seeds, no log-probs, no prompt check); returns the tokens generated."""
        sampling = vllm.SamplingParams(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": list(ids)} for ids in prompt_ids], sampling, use_tqdm=False)
        return sum(len(output.outputs[0].token_ids) for output in outputs)

    def _encode(self, text: str) -> list[int]:
        """The engine tokenizer's ids of `text`, without special tokens (Qwen3-VL's timestamps)."""
        return list(self.llm.get_tokenizer().encode(text, add_special_tokens=False))

    def _prompts(self, requests: Sequence[RolloutRequest]) -> list[dict[str, Any]]:
        """vLLM prompts; the n samples of a prompt share one (their items are the same objects)."""
        built: dict[tuple, dict[str, Any]] = {}
        prompts = []
        for request in requests:
            if request.items and not self.is_vision_language:
                raise ValueError(f"rollout request {request.sample_key!r}: has media but the model has no vision tower")
            if len(request.prompt_ids) >= self.max_model_len:
                raise ValueError(f"rollout request {request.sample_key!r}: its prompt has {len(request.prompt_ids)} "
                                 f"tokens, the engine serves {self.max_model_len} (flexrl.rollout.vllm.max_model_len)")
            key = (tuple(request.prompt_ids), tuple(id(item.pixel_values) for item in request.items))
            if key not in built:
                built[key] = build_prompt(request, self.tokens, self.geometry, self._encode)
            prompts.append(built[key])
        return prompts

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket into the engine's model (HF names; vLLM maps them to its fused modules)."""
        self._wake_weights()
        bucket = list(named_tensors)
        self.llm.apply_model(lambda model: model.load_weights(iter(bucket)))

    def _wake_weights(self) -> None:
        """Before weights are loaded into a sleeping engine: bring its weights back (not its KV cache)."""
        if "weights" in self._asleep:
            self.llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")
            if self.sleep_level == 2:
                self.llm.apply_model(_zero_deepstack_scratch)

    @property
    def channel_ranks(self) -> int:
        """Receivers this engine adds to a weight channel: one per worker (tensor-parallel shard)."""
        return self.tensor_parallel_size

    def join_weight_channel(self, address: ChannelAddress, first_rank: int) -> None:
        """Separate engines: every worker joins policy rank 0's channel as receiver first_rank + its
        rank (rollout/vllm_workers.py); blocks until the whole channel has joined."""
        join = WeightReceiverExtension.flexrl_join_weight_channel.__name__
        joined = self.llm.collective_rpc(join, args=(asdict(address), first_rank))
        expected = list(range(first_rank, first_rank + self.tensor_parallel_size))
        if sorted(joined) != expected:
            raise RuntimeError(f"vLLM engine: its workers joined the weight channel as ranks {sorted(joined)}, not "
                               f"{expected} (one per shard of tensor_parallel_size {self.tensor_parallel_size})")

    def receive_weights(self) -> int:
        """Separate engines: one sync's buckets, loaded by the workers as they arrive; returns the
        tensors loaded (per worker: each loads every tensor and keeps its shard)."""
        self._wake_weights()
        counts = self.llm.collective_rpc(WeightReceiverExtension.flexrl_receive_weights.__name__)
        if len(set(counts)) != 1:
            raise RuntimeError(f"vLLM engine: its workers loaded different numbers of tensors in one sync: {counts}")
        return int(counts[0])

    def reset_caches(self) -> None:
        """Forget everything computed with the previous weights: prefix KV, processed media and
        vision-encoder outputs (called after every sync; an engine that never sleeps would otherwise
        reuse them, and EasyR1 saw the encoder cache grow until the update ran out of memory)."""
        self.llm.reset_prefix_cache()
        self.llm.reset_mm_cache()
        self.llm.llm_engine.reset_encoder_cache()

    def sleep(self) -> None:
        """Free the GPU for training: the KV cache is dropped (vLLM also clears its prefix, media and
        encoder caches) and the weights offloaded (level 1) or dropped (level 2: the next sync must
        bring every weight, and skips copying the host backup back first)."""
        if self._asleep == {"weights", "kv_cache"}:
            return
        if self._asleep:  # partly awake after a sync: vLLM sleeps only a fully awake engine
            self.llm.wake_up(tags=sorted(self._asleep))
        self.llm.sleep(level=self.sleep_level)
        self._asleep = {"weights", "kv_cache"}

    def wake(self) -> None:
        """Undo sleep (what a weight sync has already woken stays as it is)."""
        if self._asleep:
            self.llm.wake_up(tags=sorted(self._asleep))
            self._asleep.clear()


def _zero_deepstack_scratch(model: Any) -> None:
    """vLLM 0.26's Qwen3-VL keeps the DeepStack rows of a step in plain tensors allocated with the
    weights (`deepstack_input_embeds`, not buffers: a level-2 sleep neither keeps nor restores them)
    and adds them to the first decoder layers of every forward, relying on them being zero outside the
    rows it wrote: after a level-2 sleep they are zeroed again once the weights' memory is back."""
    for scratch in getattr(model, "deepstack_input_embeds", None) or []:
        scratch.zero_()


def _moe_kwargs(model_dir: Path) -> dict[str, str]:
    """A sparse decoder (Qwen3-VL MoE) runs on vLLM's Triton experts, which use the fused expert weights
    as loaded: the FlashInfer kernels (vLLM's first choice on some GPUs, not Hopper) rearrange them once
    after the first load, so the weights a sync writes later would be read in the wrong layout."""
    config = json.loads((model_dir / "config.json").read_text())
    return {"moe_backend": "triton"} if config.get("text_config", config).get("num_experts") else {}


def _max_model_len(max_model_len: int | None) -> int:
    """None: the model config's length where the engine's KV cache holds one request of it, else the
    longest it holds (vLLM's auto-fit, -1). Qwen3-VL configs say 262,144 tokens, whose KV cache
    (about 39 GB for the 8B) a colocated engine's memory share may not hold: vLLM would refuse to start."""
    return -1 if max_model_len is None else max_model_len


def _executor_backend(in_world: bool, tensor_parallel_size: int) -> str | None:
    """Inside a policy rank: join its torch.distributed world. A tensor-parallel engine: one worker
    process per shard on the GPUs this (Ray) process was given ("mp", never vLLM's own Ray actors,
    which would ask Ray for GPUs this engine already holds). Otherwise the worker stays in process."""
    if in_world:
        return "external_launcher"
    return "mp" if tensor_parallel_size > 1 else None


def _processor_knows_frame_cap() -> bool:
    """Whether the installed transformers' Qwen2-VL video processor takes `cap_pixels_per_frame`."""
    try:
        from transformers.models.qwen2_vl import video_processing_qwen2_vl as module  # lazy: needs torchvision
    except ImportError:
        return False
    return "cap_pixels_per_frame" in inspect.signature(module.Qwen2VLVideoProcessor._preprocess).parameters


@contextlib.contextmanager
def _local_rank_of(device: Any) -> Iterator[None]:
    """vLLM places itself on cuda:LOCAL_RANK: point it at this engine's device while it starts."""
    index = torch.device(device).index if device is not None else None
    if index is None:
        yield
        return
    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(index)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved
