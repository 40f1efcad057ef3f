"""Where a rollout engine runs: pulls its prompts' pixels itself, then generates.

`RolloutHost` is a plain class holding one engine (`rollout/base.engine_class(backend)`). For a
step it receives `PromptJob`s (token ids, item kinds/grids, per-sample seeds: metadata only), pulls
the whole media items of those prompts from the preprocessing actors through the run's
`PixelSource` (the driver never holds pixels), and generates the n samples of each prompt. The
host lives either inside each policy worker (`flexrl.trainer.colocate`: weights copied in process)
or in a Ray actor of its own (weights arrive as buckets over policy rank 0's weight channel:
runtime/weight_channel.py: shared in place on one GPU, NCCL between GPUs, gloo on CPU).
`RolloutGroup` spreads a step's prompts over the hosts and collects the results.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from flexrl_ds.loader.materializer import SliceRequest
from flexrl_ds.loader.metastore import PromptKey
from flexrl_ds.models.processing import VisionItem
from flexrl_ds.rollout.base import RolloutRequest, RolloutResult, SamplingParams, engine_class
from flexrl_ds.runtime.data_controller import prompt_name
from flexrl_ds.runtime.weight_channel import ChannelAddress, WeightChannel

if TYPE_CHECKING:
    from flexrl_ds.runtime.data_controller import PixelSource


@dataclass(frozen=True)
class PromptJob:
    """One prompt to sample n responses for (no pixels inside)."""

    key: PromptKey
    """(step, slot): where its pixels live."""
    prompt_ids: tuple[int, ...]
    """Chat-rendered prompt with expanded vision pads."""
    items: tuple[tuple, ...]
    """(kind, grid_thw, second_per_grid_t[, frame_indices, source_fps]) per media item, in prompt order
    (a video's source frames and fps: Qwen3-VL's timestamps for vLLM)."""
    samples: tuple[tuple[str, int], ...]
    """(sample name, sampling seed) of each of its n samples."""


@dataclass
class RolloutOutput:
    """What a host returns for one call."""

    results: list[RolloutResult]
    """One per sample of the prompts it could serve."""
    withdrawn: dict[str, str]
    """Prompt name -> reason, for prompts whose media failed to decode after hand-out."""
    pixel_bytes: int = 0
    """Pixel bytes the host pulled from the preprocessing actors."""
    times_s: dict[str, float] = field(default_factory=dict)
    """Where the call's seconds went (`ROLLOUT_PARTS`)."""
    engine_peak_bytes: int = 0
    """An engine inside a policy rank on a GPU: the most memory in use on that GPU from the engine's
    wake to the end of its generation (every allocator, sampled); 0 elsewhere."""


ROLLOUT_PARTS = ("pixels", "generate", "offload", "wake", "sleep", "reload")
"""Parts of a rollout call, timed apart: "pixels" (the pulls from the preprocessing actors),
"generate" (the engine's, vision tower included), and for an engine inside a policy rank "offload"
(the ZeRO-3 states to host memory and torch's cached blocks back to the device), "wake" (the
engine's), "sleep" (the engine's) and "reload" (the states back onto the device). Building the
requests and Ray's transfers are in none of them."""


class RolloutHost:
    """One rollout engine and its pixel pulls."""

    def __init__(self, backend: str, model_dir: str, pixels: PixelSource | None, dtype: str = "float32",
                 device: Any = None, max_batch_sequences: int = 64, engine_options: dict[str, Any] | None = None):
        """pixels: the run's `PixelSource` (data_controller.py); engine_options:
        `RolloutConfig.engine_options(colocated=...)` (inside a policy rank or not)."""
        self.engine = engine_class(backend)(model_dir, dtype=dtype, device=device,
                                            max_batch_sequences=max_batch_sequences, **(engine_options or {}))
        self.pixels = pixels

    def generate(self, step: int, jobs: Sequence[PromptJob], params: SamplingParams) -> RolloutOutput:
        started = time.perf_counter()
        requests = [SliceRequest(job.key, index) for job in jobs for index in range(len(job.items))]
        fetched = self.pixels.fetch(step, requests) if requests else None
        times = {"pixels": time.perf_counter() - started}
        pixels: dict[tuple[PromptKey, int], Any] = {}
        withdrawn: dict[str, str] = {}
        if fetched is not None:
            withdrawn = {prompt_name(key): bad.reason for key, bad in fetched.withdrawn.items()}
            for request, tensors in fetched.delivered():
                pixels[(request.prompt, request.item_index)] = tensors["pixel_values"].float()
        rollout_requests: list[RolloutRequest] = []
        for job in jobs:
            if prompt_name(job.key) in withdrawn:
                continue
            missing = [index for index in range(len(job.items)) if (job.key, index) not in pixels]
            if missing:
                raise RuntimeError(f"step {step}: prompt {prompt_name(job.key)!r}: items {missing} were neither "
                                   "delivered nor withdrawn by the preprocessing actors")
            items = [VisionItem(kind, pixels[(job.key, index)], tuple(grid), spgt, None, *video)  # type: ignore[arg-type]
                     for index, (kind, grid, spgt, *video) in enumerate(job.items)]
            rollout_requests.extend(RolloutRequest(name, list(job.prompt_ids), items, seed)
                                    for name, seed in job.samples)
        started = time.perf_counter()
        results = self.engine.generate(rollout_requests, params) if rollout_requests else []
        times["generate"] = time.perf_counter() - started
        return RolloutOutput(results, withdrawn, fetched.bytes_fetched if fetched is not None else 0, times)

    def channel_ranks(self) -> int:
        """Receivers this host adds to the weight channel: the engine's workers (vLLM: one per
        tensor-parallel shard), else one (the host receives for its engine)."""
        return getattr(self.engine, "channel_ranks", 1)

    def join_weight_channel(self, address: ChannelAddress, first_rank: int) -> bool:
        """Join policy rank 0's weight channel as receivers first_rank.. (blocks until all join)."""
        if self._engine_receives():
            self.engine.join_weight_channel(address, first_rank)
        else:
            self.channel = WeightChannel(address, first_rank)
        return True

    def receive_weights(self) -> int:
        """Load one sync's buckets as they arrive over the weight channel; returns the tensors loaded."""
        if self._engine_receives():
            count = self.engine.receive_weights()
        else:
            count = self.channel.load_each(self.engine.load_weights)
        self.engine.reset_caches()  # nothing computed with the old weights may be reused
        return count

    def _engine_receives(self) -> bool:
        """Whether the engine's own workers join the channel (vLLM) rather than this host."""
        return hasattr(self.engine, "join_weight_channel")

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()


def spread_jobs(jobs: Sequence[PromptJob], num_hosts: int) -> list[list[PromptJob]]:
    """Prompts dealt to hosts by generated-sequence count (largest prompt first, least-loaded host)."""
    shares: list[list[PromptJob]] = [[] for _ in range(num_hosts)]
    loads = [0] * num_hosts
    for job in sorted(jobs, key=lambda j: -len(j.prompt_ids) * len(j.samples)):
        host = min(range(num_hosts), key=lambda h: (loads[h], h))
        shares[host].append(job)
        loads[host] += len(job.prompt_ids) * len(job.samples)
    return shares
