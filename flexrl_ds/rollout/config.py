"""Rollout settings (section `flexrl.rollout` of a run config): which engine samples the responses and how."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

BACKEND_NAMES = ("hf", "vllm")
"""hf: batched HF `generate` with a KV cache (CPU, tests, fallback); vllm: vLLM engines (GPU).
The names of `rollout.base.ROLLOUT_BACKENDS` (kept here so the config needs no engine imports)."""


SEEDING_MODES = ("sample", "off")
"""`VLLMOptions.seeding` values."""

KV_CACHE_MODES = ("dynamic", "static")
"""`HFOptions.kv_cache` values."""


SLEEP_LEVELS = (1, 2)
"""`HFOptions.sleep_level` and `VLLMOptions.sleep_level` values."""


def check_sleep_level(backend: str, level: int) -> None:
    """Refuse a sleep level other than SLEEP_LEVELS, naming the key `flexrl.rollout.<backend>.sleep_level`."""
    if level not in SLEEP_LEVELS:
        raise ValueError(f"flexrl.rollout.{backend}.sleep_level: 1 or 2, got {level}")


@dataclass
class HFOptions:
    """Settings of the hf backend's engines (section `flexrl.rollout.hf`; rollout/hf_engine.py)."""

    kv_cache: str = "dynamic"
    """The KV cache of each `generate` call:
    - "dynamic": grows by one token per step (HF's default);
    - "static": allocated once per call at prompt + `max_response_length` tokens, not compiled
      (the batch shapes change from call to call). On one H200 it made 0.6-0.9x the dynamic
      cache's tokens/s (docs/BENCHMARKS.md, "Rollout: vLLM vs HF generate")."""
    sleep_level: int = 2
    """While the policy trains (colocated engines), as vLLM's `sleep_level`: 2 frees the engine's
    weights, and the weight sync after the update allocates and writes every one straight on the
    device (waking with a weight not written since is refused); 1 moves them to host memory and
    back, and the sync writes them there. Colocated engines at level 2 start without reading the
    model directory's weights (their first sleep would free them; the sync before step 0 writes
    them: `RolloutConfig.engine_options`). On one H200 (docs/BENCHMARKS.md, "Rollout: vLLM vs HF
    generate"), 3B: level 2's steps took 36% less time than level 1's (sleep 0.07 s instead of
    4.1-4.3, sync 0.07-0.08 s instead of 4.7-4.8); 7B: level 1's host copy did not fit next to the
    offloaded optimizer, level 2 ran."""

    def __post_init__(self) -> None:
        if self.kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"flexrl.rollout.hf.kv_cache: {' | '.join(KV_CACHE_MODES)}, got {self.kv_cache!r}")
        check_sleep_level("hf", self.sleep_level)


@dataclass
class VLLMOptions:
    """Settings of the vllm backend's engines (section `flexrl.rollout.vllm`; rollout/vllm_engine.py)."""

    gpu_memory_utilization: float = 0.35
    """Fraction of the GPU's memory an engine may take for weights and KV cache while awake; colocated
    with the policy it must fit next to the ZeRO-3 states present when the engine starts."""
    tensor_parallel_size: int = 1
    """GPUs one engine spans (tensor parallel inside the engine). Above 1 only for separate engines
    (`flexrl.trainer.colocate` false) with `flexrl.rollout.num_gpus_per_engine` equal to it: each
    shard's worker receives the weights itself (rollout/vllm_workers.py)."""
    enforce_eager: bool = False
    """Skip CUDA graph capture (faster start, slower decoding)."""
    load_format: str = "auto"
    """How the engine first loads the model directory, as vLLM's `load_format`:
    - "auto": the directory's safetensors files, else its PyTorch .bin files (vLLM's default);
    - "safetensors": read the safetensors files;
    - "dummy": random weights, no disk read; the trainer syncs the policy's before step 0.
    Engines that drop their weights at start (colocated at sleep_level 2,
    `RolloutConfig.engines_drop_weights_at_start`) get "dummy" in place of "auto" only
    (`RolloutConfig.engine_options`); "safetensors" is kept and still read."""
    max_model_len: int | None = None
    """Longest prompt + response an engine serves; None: the model config's."""
    sleep_level: int = 1
    """While the policy trains: 1 offloads the engine's weights to host memory, 2 drops them (every
    sync then rewrites all of them and skips copying the backup back). Both drop the KV cache."""
    max_images_per_prompt: int | None = None
    """Images one prompt may carry (vLLM sizes its encoder budget by it); None: the most any record
    of the run's dataset has (at least 1), found before the workers start."""
    max_videos_per_prompt: int | None = None
    """Videos one prompt may carry; None: from the dataset, as for images."""
    seeding: str = "sample"
    """How samples are seeded:
    - "sample": each request carries its sample's seed, so its response depends only on that seed
      (not on the batch) and a resumed run regenerates it; vLLM 0.26's model runner samples seeded
      requests in one batched pass (measured: within 2% of unseeded);
    - "off": vLLM picks the seeds (from numpy's global generator), not reproducible."""

    def __post_init__(self) -> None:
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"flexrl.rollout.vllm.gpu_memory_utilization: must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        check_sleep_level("vllm", self.sleep_level)
        if self.load_format not in ("auto", "dummy", "safetensors"):
            raise ValueError(f"flexrl.rollout.vllm.load_format: auto | dummy | safetensors, got {self.load_format!r}")
        if self.seeding not in SEEDING_MODES:
            raise ValueError(f"flexrl.rollout.vllm.seeding: {' | '.join(SEEDING_MODES)}, got {self.seeding!r}")
        for name in ("tensor_parallel_size", "max_images_per_prompt", "max_videos_per_prompt"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"flexrl.rollout.vllm.{name}: must be at least 1, got {getattr(self, name)}")


@dataclass
class RolloutConfig:
    """How the rollout engines sample n responses per prompt (section `flexrl.rollout`)."""

    backend: Literal["hf", "vllm"] = "hf"
    """Rollout engine implementation (BACKEND_NAMES)."""
    num_engines: int = 1
    """Rollout engines, each a Ray actor holding a full copy of the policy's weights. Used only with
    `flexrl.trainer.colocate` false; colocated, each policy rank holds one engine."""
    max_response_length: int = 1024
    """Most new tokens per response; generation also stops at the tokenizer's EOS."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy decoding (the trainer refuses it: a prompt's samples
    would all be the same). The trainer's log-probs (policy, reference, old) and the hf engine's are
    those of the logits divided by it, before top-k / top-p. A vllm engine's are the same at
    temperature 1; at another temperature they are vLLM's processed ones, taken after top-k / top-p
    and renormalised over the tokens kept (`logprob_diff_caveat`)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; 1.0: off."""
    top_k: int = 0
    """Keep the k most likely tokens; 0: off."""
    max_batch_sequences: int = 64
    """Most sequences one engine generates in one batched call."""
    num_cpus_per_engine: float = 1.0
    """Ray CPUs reserved per engine (fractions allowed). Used only with `flexrl.trainer.colocate`
    false."""
    num_gpus_per_engine: float = 0.0
    """Ray GPUs reserved per engine (0 on CPU machines). Used only with `flexrl.trainer.colocate`
    false; a fraction lets separate engines share a GPU with a policy rank."""
    vllm: VLLMOptions = field(default_factory=VLLMOptions)
    """Engine settings of the vllm backend (ignored by hf)."""
    hf: HFOptions = field(default_factory=HFOptions)
    """Engine settings of the hf backend (ignored by vllm)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_NAMES:
            raise ValueError(f"flexrl.rollout.backend: {self.backend!r} is not one of {', '.join(BACKEND_NAMES)}")
        for name in ("num_engines", "max_response_length", "max_batch_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"flexrl.rollout.{name}: must be at least 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"flexrl.rollout.temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"flexrl.rollout.top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"flexrl.rollout.top_k: must be >= 0 (0: off), got {self.top_k}")
        if self.num_cpus_per_engine <= 0 or self.num_gpus_per_engine < 0:
            raise ValueError("flexrl.rollout.num_cpus_per_engine must be > 0 and num_gpus_per_engine >= 0")

    def logprob_diff_caveat(self) -> str | None:
        """Why this run's `rollout_logprob_diff` will not be near zero even with the engines' weights
        right, or None. A vllm engine at a temperature other than 1 returns vLLM's processed log-probs
        (vllm_inputs.logprobs_mode): after top-k / top-p, renormalised over the tokens they keep. The
        trainer's (and the hf engine's) are those before the filter, what the loss needs."""
        filtered = self.top_k > 0 or self.top_p < 1
        if self.backend != "vllm" or self.temperature in (0, 1) or not filtered:
            return None
        return (f"flexrl.rollout: the vllm engines sample at temperature {self.temperature} with top_k "
                f"{self.top_k} and top_p {self.top_p}, and their log-probs are taken after that filter, "
                "renormalised over the tokens it keeps; the trainer's are taken before it. So "
                "rollout_logprob_diff includes the log of the probability mass the filter keeps and does "
                "not check the engines' weights in this run (the loss uses the trainer's log-probs only). "
                "At temperature 1, or without top_k / top_p, it does (without them, up to a small gap: "
                "vLLM's processed log-probs also renormalise over the tokens the trainer suppresses, "
                "the vision token ids sent as logit_bias).")

    def engine_options(self, *, colocated: bool) -> dict[str, Any]:
        """Keyword arguments the chosen backend's engine takes beyond the common ones, for engines
        inside the policy ranks (`colocated`) or in actors of their own. Engines that would free
        their weights at their first sleep (`engines_drop_weights_at_start`) start without reading
        the model directory's: hf with `load_weights_at_start` False (rollout/hf_engine.py), vllm
        with `load_format` "dummy" in place of "auto" (random weights, no disk read); the trainer
        syncs every weight before step 0 in that case (`engines_start_without_policy_weights`). vllm
        engines take their log-probs at the run's temperature (`logprob_temperature`; hf ones at each
        request's)."""
        skip_weights = self.engines_drop_weights_at_start(colocated)
        if self.backend == "hf":
            return {**asdict(self.hf), "load_weights_at_start": not skip_weights}
        options = {**asdict(self.vllm), "logprob_temperature": self.temperature if self.temperature > 0 else 1.0}
        if skip_weights and options["load_format"] == "auto":
            options["load_format"] = "dummy"
        return options

    def engines_drop_weights_at_start(self, colocated: bool) -> bool:
        """Whether the engines free their weights as soon as they start: colocated engines sleep right
        after starting (the policy trains first), and at sleep_level 2 a sleep frees the weights."""
        sleep_level = self.hf.sleep_level if self.backend == "hf" else self.vllm.sleep_level
        return colocated and sleep_level == 2

    def engines_start_without_policy_weights(self, colocated: bool) -> bool:
        """Whether the engines' weights differ from the model directory's when step 0 begins, so the
        trainer must sync before it: vllm with random weights (load_format dummy), or engines that
        free their weights at once (`engines_drop_weights_at_start`: colocated at sleep_level 2; they
        also start without reading them, `engine_options`)."""
        random_weights = self.backend == "vllm" and self.vllm.load_format == "dummy"
        return random_weights or self.engines_drop_weights_at_start(colocated)
