"""The vllm backend's options (section `flexrl.rollout.vllm`): what its engines (rollout/vllm_engine.py)
take and what they need from a run: GPUs, a tensor-parallel engine's placement, per-prompt media
limits from the records, the log-probs' caveat at a filtered temperature. Imports no vLLM."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from flexrl_ds.media.types import Record
from flexrl_ds.rollout.base import BackendOptions, check_sleep_level

if TYPE_CHECKING:
    from flexrl_ds.rollout.config import RolloutConfig

SEEDING_MODES = ("sample", "off")
"""`VLLMOptions.seeding` values."""


@dataclass
class VLLMOptions(BackendOptions):
    """Settings of the vllm backend's engines (section `flexrl.rollout.vllm`; rollout/vllm_engine.py)."""

    needs_gpu: ClassVar[bool] = True

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
    """Longest prompt + response an engine serves; None: the model config's, or the longest the
    engine's KV cache holds where that is less (vLLM's auto-fit; the engine logs "Auto-fit max_model_len")."""
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

    def engine_options(self, rollout: RolloutConfig, skip_weights: bool) -> dict[str, Any]:
        """Engines that free their weights at their first sleep start with `load_format` "dummy" in
        place of "auto" (random weights, no disk read); the log-probs are taken at the run's
        temperature (`logprob_temperature`; 1 for greedy)."""
        options = {**asdict(self), "logprob_temperature": rollout.temperature if rollout.temperature > 0 else 1.0}
        if skip_weights and options["load_format"] == "auto":
            options["load_format"] = "dummy"
        return options

    def starts_with_random_weights(self) -> bool:
        return self.load_format == "dummy"

    def logprob_diff_caveat(self, rollout: RolloutConfig) -> str | None:
        """At a temperature other than 1 with top-k / top-p, vLLM returns its processed log-probs
        (vllm_inputs.logprobs_mode): after the filter, renormalised over the tokens it keeps. The
        trainer's are those before the filter, what the loss needs."""
        filtered = rollout.top_k > 0 or rollout.top_p < 1
        if rollout.temperature in (0, 1) or not filtered:
            return None
        return (f"flexrl.rollout: the vllm engines sample at temperature {rollout.temperature} with top_k "
                f"{rollout.top_k} and top_p {rollout.top_p}, and their log-probs are taken after that filter, "
                "renormalised over the tokens it keeps; the trainer's are taken before it. So "
                "rollout_logprob_diff includes the log of the probability mass the filter keeps and does "
                "not check the engines' weights in this run (the loss uses the trainer's log-probs only). "
                "At temperature 1, or without top_k / top_p, it does (without them, up to a small gap: "
                "vLLM's processed log-probs also renormalise over the tokens the trainer suppresses, "
                "the vision token ids sent as logit_bias).")

    def check_placement(self, rollout: RolloutConfig, colocated: bool) -> None:
        """A tensor-parallel engine is a separate engine with one whole GPU per shard."""
        size = self.tensor_parallel_size
        if size == 1:
            return
        if colocated:
            raise ValueError(f"flexrl.rollout.vllm.tensor_parallel_size: {size} needs separate engines "
                             f"(flexrl.trainer.colocate false); a colocated engine holds the whole model in its rank")
        if rollout.num_gpus_per_engine != size:
            raise ValueError(f"flexrl.rollout.num_gpus_per_engine: a tensor-parallel engine takes one whole GPU "
                             f"per shard, so it must equal flexrl.rollout.vllm.tensor_parallel_size ({size}); "
                             f"got {rollout.num_gpus_per_engine}")

    def resolved_for(self, records: Sequence[Any]) -> VLLMOptions:
        """The per-prompt image/video limits for this dataset (its usable records; bad rows carry no
        media). A limit left None becomes the most any record has (at least 1: vLLM sizes its encoder
        budget by it, so no more than the data needs); a limit set explicitly must hold every record
        (vLLM would fail the whole generate call of a step with one such prompt), else ValueError
        naming the record."""
        limits: dict[str, Any] = {}
        for kind in ("image", "video"):
            name = f"max_{kind}s_per_prompt"
            limit = getattr(self, name)
            counts = {record.id: sum(1 for item in record.items if item.kind == kind) for record in records
                      if isinstance(record, Record)}  # bad rows are kept for the loader's policy, without media
            if limit is None:
                limits[name] = max([1, *counts.values()])
                continue
            for record_id, count in counts.items():
                if count > limit:
                    raise ValueError(f"record {record_id!r}: {count} {kind}s, more than flexrl.rollout.vllm.{name} = "
                                     f"{limit} (raise it, leave it unset to size it from the data, or drop the record)")
            limits[name] = limit
        return replace(self, **limits)
