"""Where a policy rank's step time goes: torch.profiler over chosen phases, and flexrl's own regions.

`region(name)` marks a part of a pass ("flexrl/forward", "flexrl/backward", ...; inside a forward,
"flexrl/vision_tower", "flexrl/decoder" and "flexrl/lm_head") for the profiler;
it costs next to nothing while no profile runs. `RankProfiler.start()` / `.stop(stem)` profile
what runs in between (CPU, and the GPU's kernels where there is one) and write:
- `<stem>.txt`: the profiled wall time and, with a GPU, how much of it the device spent in kernels
  (a low share means the host is the bottleneck: launches, hooks, synchronisations); flexrl's
  regions by total time (what each part of the pass took, its kernels included); the 40 ops with
  the most self time on the device (CPU without one); with a GPU also the 25 ops with the most
  self time on the CPU;
- `<stem>.json.gz`: the trace, for Perfetto (ui.perfetto.dev) or chrome://tracing.
`flexrl.trainer.profile_step` asks every policy rank for one step's log-prob, update and sync phases.
On one H200 a profiled 3B step (64 samples, 32k tokens, colocated vLLM) took ~140 s longer than
an unprofiled one, most of it writing the trace (docs/BENCHMARKS.md "seventeenth run").
"""

from __future__ import annotations

import time
from pathlib import Path

from torch.profiler import profile, record_function

from flexrl_ds.parallel import device as device_mod

PREFIX = "flexrl/"


def region(name: str):
    """A context marking `flexrl/<name>` in a profile."""
    return record_function(PREFIX + name)


class RankProfiler:
    """One profile at a time on this process."""

    def __init__(self):
        self.active: profile | None = None
        self.started = 0.0

    def start(self) -> None:
        if self.active is not None:
            raise RuntimeError("a profile is already running on this rank")
        self.active = profile(activities=device_mod.profiler_activities())
        self.active.start()
        self.started = time.perf_counter()

    def stop(self, stem: str | Path) -> str:
        """End the profile; write `<stem>.txt` and `<stem>.json.gz`; returns the .txt path."""
        if self.active is None:
            raise RuntimeError("no profile is running on this rank")
        prof, self.active = self.active, None
        wall_seconds = time.perf_counter() - self.started
        prof.stop()
        stem = Path(stem)
        stem.parent.mkdir(parents=True, exist_ok=True)
        text = profile_tables(prof.key_averages(), device=device_mod.gpu_available(), wall_seconds=wall_seconds)
        (stem.parent / f"{stem.name}.txt").write_text(text)  # first: the trace of a big step takes longer
        prof.export_chrome_trace(str(stem.parent / f"{stem.name}.json.gz"))
        return str(stem.parent / f"{stem.name}.txt")


def profile_tables(averages, device: bool, wall_seconds: float | None = None) -> str:
    """The wall and device-busy times, flexrl's regions by total time, then the ops with the most
    self time (device, else CPU; with a device also by CPU)."""
    lines = [] if wall_seconds is None else [_busy_line(averages, device, wall_seconds), ""]
    lines += region_table(averages, device)
    if device:
        lines += ["", averages.table(sort_by="self_device_time_total", row_limit=40),
                  "ops by self CPU time (host work between the kernels):",
                  averages.table(sort_by="self_cpu_time_total", row_limit=25)]
    else:
        lines += ["", averages.table(sort_by="self_cpu_time_total", row_limit=40)]
    return "\n".join(lines) + "\n"


def device_kernel_seconds(averages) -> float:
    """Seconds of kernels and copies on the device (user annotations such as flexrl's regions,
    which the profiler also places on the device's timeline, left out)."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in averages
               if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)) / 1e6


def _busy_line(averages, device: bool, wall_seconds: float) -> str:
    line = f"profiled {wall_seconds:.2f} s of wall time"
    if device:
        busy = device_kernel_seconds(averages)
        line += f"; the device ran kernels for {busy:.2f} s of it ({busy / max(wall_seconds, 1e-9):.0%})"
    return line


def region_table(averages, device: bool) -> list[str]:
    """One row per flexrl region: calls, CPU total and (with a device) device total. The profiler
    reports a region twice where there is a device (its CPU range, and its span on the device):
    the two are merged."""
    merged: dict[str, list[float]] = {}
    for event in averages:
        if event.key.startswith(PREFIX):
            row = merged.setdefault(event.key, [0, 0.0, 0.0])
            row[0] = max(row[0], event.count)
            row[1] = max(row[1], event.cpu_time_total / 1e3)
            row[2] = max(row[2], event.device_time_total / 1e3)
    order = sorted(merged.items(), key=lambda item: -(item[1][2] if device else item[1][1]))
    lines = [f"{'flexrl region':<32} {'calls':>6} {'CPU total ms':>13}" + (f" {'device total ms':>16}" if device else "")]
    for key, (calls, cpu_ms, device_ms) in order:
        lines.append(f"{key:<32} {calls:>6} {cpu_ms:>13.1f}" + (f" {device_ms:>16.1f}" if device else ""))
    return lines
