"""What each step's data loading cost (metrics.jsonl `loader`): the time the loop waited for data,
the bytes that went through the loader's controller, and the controller's and the driver's peak
memory, so that `flexrl.data.loading` "central" (the veRL-style baseline) and "shadow" (the
ShadowLoader) compare on the same run (docs/OUTPUTS.md)."""

from __future__ import annotations

import resource
from typing import Any


def driver_peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class LoaderAccounting:
    """Per step, `step(times, rollout_info)` -> {"loader": {...}}; counters are the controller's
    running totals, turned into the step's own."""

    def __init__(self, controller: Any, loading: str):
        """`controller`: the run's `DataController`; `loading`: `flexrl.data.loading`."""
        self.controller, self.loading = controller, loading
        self.bytes_so_far = 0

    def step(self, times: dict[str, float], rollout_info: dict[str, Any]) -> dict[str, Any]:
        total = int(self.controller.stats()["bytes_through_controller"])
        moved, self.bytes_so_far = total - self.bytes_so_far, total
        pulls = rollout_info.get("rollout_time_s", {}).get("pixels", 0.0)
        return {"loader": {
            "loading": self.loading,
            "exposed_s": times.get("data", 0.0) + pulls,
            "bytes_through_controller": moved,
            "controller_peak_rss_gb": self.controller.peak_rss_bytes() / 2**30,
            "driver_peak_rss_gb": driver_peak_rss_bytes() / 2**30}}
