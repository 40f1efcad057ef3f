"""Centralised baseline loader: the veRL-style path behind ShadowLoader's interface.

The controller probes *and decodes* every prompt of the step itself with the same
`SamplePreprocessor` (through the same `SliceMaker`, so tensors are identical), holds the pixel
tensors in its own memory and ships them to workers inside their `WorkerAssignment`s
(`PromptSource.inline`). Decoding sits on the training loop's critical path: `next_step()` returns
only when the step's pixels are ready, as in a synchronous driver-side data loader. Step order and
bad-record handling are ShadowLoader's (`proxy_loader.StepSource`), so both paths train on the same
samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from flexrl_ds.loader.actors import SliceMaker, item_layouts
from flexrl_ds.loader.config import LoaderConfig
from flexrl_ds.loader.materializer import PromptSource, SliceRequest, WorkerAssignment, chunk_keys_for
from flexrl_ds.loader.metastore import ItemLayout, PromptKey, SliceKey
from flexrl_ds.loader.proxy_loader import LoaderStats, LoaderStep, StepSource
from flexrl_ds.media.types import BadMediaError


class CentralLoader:
    """Controller decodes everything; workers receive tensors through the controller."""

    def __init__(self, records: Sequence[Any], make_preprocessor: Callable[[], Any], config: LoaderConfig,
                 bad_record_policy: str = "skip"):
        """`config`: the run's `flexrl.data.loader`; `bad_record_policy`: its
        `flexrl.data.bad_record_policy` (as for `ProxyLoader`)."""
        self.config = config
        self.maker = SliceMaker(make_preprocessor)
        self.source = StepSource(records, config, self.maker.probe, bad_record_policy)
        self._prompts: dict[PromptKey, tuple[tuple[ItemLayout, ...], dict[SliceKey, dict]]] = {}

    @property
    def stats(self) -> LoaderStats:
        return self.source.stats

    def skip_steps(self, num_steps: int) -> None:
        """Replay the order and the bad-record policy over `num_steps` steps, probing only (resume)."""
        for _ in range(num_steps):
            self.source.compose()

    def next_step(self) -> LoaderStep:
        """Compose the next step and decode all its media here, in the controller."""
        started = time.perf_counter()
        step = self.source.settle(self.source.compose(), self._decode)
        self.stats.loader_s += time.perf_counter() - started
        return step

    def _decode(self, prompt: Any) -> Any:
        """Decode one prompt here; None on success, its `BadRecord` when decoding fails."""
        layouts = item_layouts(prompt.meta, self.config.groups_per_chunk)
        try:
            self._prompts[prompt.key] = (layouts, self.maker.make_slices(prompt.key, prompt.meta, layouts))
        except BadMediaError as error:
            return error.bad
        return None

    def assignment(self, step: LoaderStep, requests: Sequence[SliceRequest]) -> WorkerAssignment:
        """A worker's share of `step`, with the pixel tensors it needs inside."""
        sources: dict[PromptKey, PromptSource] = {}
        for key in dict.fromkeys(request.prompt for request in requests):
            layouts, slices = self._prompts[key]
            source = PromptSource(key, layouts)
            needed = chunk_keys_for(source, [r for r in requests if r.prompt == key])
            source.inline = {slice_key: slices[slice_key] for slice_key in needed}
            self.stats.bytes_through_controller += sum(v["pixel_values"].nbytes for v in source.inline.values())
            sources[key] = source
        return WorkerAssignment(step.step, tuple(requests), sources)

    def repair(self, key: PromptKey, failed_generation: int) -> PromptSource:
        raise AssertionError(f"prompt {key}: inline sources cannot be lost")

    def release(self, step: LoaderStep) -> None:
        for prompt in step.prompts:
            self._prompts.pop(prompt.key, None)
