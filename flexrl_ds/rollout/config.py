"""Rollout settings (section `flexrl.rollout` of a run config): which engine samples the responses and how."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

BACKEND_NAMES = ("hf", "vllm")
"""hf: batched HF `generate` with a KV cache (CPU, tests, fallback); vllm: vLLM engines (GPU).
The names of `rollout.base.ROLLOUT_BACKENDS` (kept here so the config needs no engine imports)."""


@dataclass
class RolloutConfig:
    """How the rollout engines sample n responses per prompt (section `flexrl.rollout`)."""

    backend: Literal["hf", "vllm"] = "hf"
    """Rollout engine implementation (BACKEND_NAMES)."""
    num_engines: int = 1
    """Rollout engines (each a Ray actor holding a full copy of the policy's weights)."""
    max_response_length: int = 1024
    """Most new tokens per response; generation also stops at the tokenizer's EOS."""
    temperature: float = 1.0
    """Sampling temperature; 0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; 1.0: off."""
    top_k: int = 0
    """Keep the k most likely tokens; 0: off."""
    max_batch_sequences: int = 64
    """Most sequences one engine generates in one batched call."""
    num_cpus_per_engine: float = 1.0
    """Ray CPUs reserved per engine (fractions allowed)."""
    num_gpus_per_engine: float = 0.0
    """Ray GPUs reserved per engine (0 on CPU machines; fractions allowed when colocated)."""

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
