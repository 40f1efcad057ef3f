"""Rollout settings (section `flexrl.rollout` of a run config): which engine samples the responses and how.

What differs between backends is their options' (rollout/base.py `BackendOptions`: rollout/hf_options.py,
rollout/vllm_options.py), reached through the registry (`RolloutConfig.options`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from flexrl_ds.rollout.base import ROLLOUT_BACKENDS, BackendOptions, check_backend, options_class
from flexrl_ds.rollout.hf_options import HFOptions
from flexrl_ds.rollout.vllm_options import VLLMOptions

BACKEND_NAMES = tuple(ROLLOUT_BACKENDS)
"""hf: batched HF `generate` with a KV cache (CPU, tests, fallback); vllm: vLLM engines (GPU).
The names registered in `rollout.base.ROLLOUT_BACKENDS` when this module was imported."""


@dataclass
class RolloutConfig:
    """How the rollout engines sample n responses per prompt (section `flexrl.rollout`)."""

    backend: str = "hf"
    """Rollout engine implementation: a name of `rollout.base.ROLLOUT_BACKENDS` (BACKEND_NAMES)."""
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
        check_backend(self.backend)
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

    @property
    def options(self) -> BackendOptions:
        """The chosen backend's options: its section of this config (`flexrl.rollout.<backend>`), or
        the defaults of its options class for a backend with no section here."""
        section = getattr(self, self.backend, None)
        return section if isinstance(section, BackendOptions) else options_class(self.backend)()

    def with_options(self, options: BackendOptions) -> RolloutConfig:
        """This config with the chosen backend's options replaced (self if they are unchanged)."""
        if options == self.options:
            return self
        assert isinstance(getattr(self, self.backend, None), BackendOptions), \
            f"backend {self.backend!r}: changed options need a section `{self.backend}` in RolloutConfig"
        return dataclasses.replace(self, **{self.backend: options})  # type: ignore[arg-type]

    def logprob_diff_caveat(self) -> str | None:
        """Why this run's `rollout_logprob_diff` will not be near zero even with the engines' weights
        right, or None (the backend's options say: vllm at a filtered temperature)."""
        return self.options.logprob_diff_caveat(self)

    def engine_options(self, *, colocated: bool) -> dict[str, Any]:
        """Keyword arguments the chosen backend's engine takes beyond the common ones, for engines
        inside the policy ranks (`colocated`) or in actors of their own. Engines that would free
        their weights at their first sleep (`engines_drop_weights_at_start`) start without reading
        the model directory's (hf: `load_weights_at_start` False; vllm: `load_format` "dummy" in
        place of "auto"); the trainer syncs every weight before step 0 in that case
        (`engines_start_without_policy_weights`). The backend's options decide the rest."""
        return self.options.engine_options(self, self.engines_drop_weights_at_start(colocated))

    def engines_drop_weights_at_start(self, colocated: bool) -> bool:
        """Whether the engines free their weights as soon as they start: colocated engines sleep right
        after starting (the policy trains first), and at sleep_level 2 a sleep frees the weights."""
        return colocated and self.options.sleep_level == 2

    def engines_start_without_policy_weights(self, colocated: bool) -> bool:
        """Whether the engines' weights differ from the model directory's when step 0 begins, so the
        trainer must sync before it: random weights (vllm's load_format dummy), or engines that free
        their weights at once (`engines_drop_weights_at_start`: colocated at sleep_level 2; they also
        start without reading them, `engine_options`)."""
        return self.options.starts_with_random_weights() or self.engines_drop_weights_at_start(colocated)
