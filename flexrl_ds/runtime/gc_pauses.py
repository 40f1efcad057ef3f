"""The time Python's garbage collector holds this process, read per phase.

A rank's process holds millions of long-lived Python objects (the model's modules, DeepSpeed's
bookkeeping, a colocated engine's), and a full collection walks them all while everything else in
the process waits: seconds that land inside whatever pass the collector interrupts. `GCPauses`
times every collection through `gc.callbacks` (`gc_pause_s` in metrics.jsonl, per phase).
"""

from __future__ import annotations

import gc
import time


class GCPauses:
    """Seconds and count of the collections since `reset`."""

    def __init__(self):
        self.seconds = 0.0
        self.collections = 0
        self._started: float | None = None
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            took = time.perf_counter() - self._started
            self.seconds += took
            self.collections += 1
            self._started = None

    def reset(self) -> None:
        self.seconds = 0.0
        self.collections = 0

    def close(self) -> None:
        """Stop timing (the callback leaves `gc.callbacks`)."""
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

