"""The hf backend's options (section `flexrl.rollout.hf`): what its engines (rollout/hf_engine.py) take
and what they need from a run. Imports no engine."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from flexrl_ds.rollout.base import BackendOptions, check_sleep_level

if TYPE_CHECKING:
    from flexrl_ds.rollout.config import RolloutConfig

KV_CACHE_MODES = ("dynamic", "static")
"""`HFOptions.kv_cache` values."""


@dataclass
class HFOptions(BackendOptions):
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
    them: `RolloutConfig.engine_options`). On one H200 (docs/BENCHMARKS.md, "Rollout: vLLM vs HF generate"),
    3B: level 2's steps took 36% less time than level 1's (sleep 0.07 s instead of 4.1-4.3, sync
    0.07-0.08 s instead of 4.7-4.8); 7B: level 1's host copy did not fit next to the offloaded
    optimizer, level 2 ran."""

    def __post_init__(self) -> None:
        if self.kv_cache not in KV_CACHE_MODES:
            raise ValueError(f"flexrl.rollout.hf.kv_cache: {' | '.join(KV_CACHE_MODES)}, got {self.kv_cache!r}")
        check_sleep_level("hf", self.sleep_level)

    def engine_options(self, rollout: RolloutConfig, skip_weights: bool) -> dict[str, Any]:
        """Engines that free their weights at their first sleep start without reading the model
        directory's (`load_weights_at_start` False, rollout/hf_engine.py)."""
        return {**asdict(self), "load_weights_at_start": not skip_weights}
