"""Where a policy rank's step time goes: torch.profiler over chosen phases, and flexrl's own regions.

`region(name)` marks a part of a pass ("flexrl/forward", "flexrl/backward", ...; inside a forward,
"flexrl/vision_tower", "flexrl/decoder" and "flexrl/lm_head") for the profiler;
it costs next to nothing while no profile runs. `RankProfiler.start()` / `.stop(stem)` profile
what runs in between (CPU, and the GPU's kernels where there is one) and write:
- `<stem>.txt`: the profiled wall time and, with a GPU, how much of it the device was running
  kernels or copies (a low share means the host is the bottleneck: launches, hooks,
  synchronisations); flexrl's regions (CPU time; with a GPU the kernels launched inside each and
  the span they cover on the device); each region's calls in order, with the host's wall time of
  each (which call took the time); the 40 ops with
  the most self time on the device (CPU without one); with a GPU also the 25 ops with the most
  self time on the CPU;
- `<stem>.json.gz`: the trace, for Perfetto (ui.perfetto.dev) or chrome://tracing.
`flexrl.trainer.profile_step` asks every policy rank for one step's log-prob, update and sync phases.
On one H200 a profiled 3B step (64 samples, 32k tokens, colocated vLLM) took ~140 s longer than
an unprofiled one, most of it writing the trace (docs/notes/one-h200-runs-2026-12-04.md, "One H200,
seventeenth run").
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from torch.overrides import TorchFunctionMode
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

    def discard(self) -> None:
        """End the running profile, if any, without writing it (the profiled work failed)."""
        if self.active is not None:
            active, self.active = self.active, None
            active.stop()

    def stop(self, stem: str | Path, trace: bool = True) -> str:
        """End the profile; write `<stem>.txt` and (with `trace`) `<stem>.json.gz`; returns the .txt path."""
        if self.active is None:
            raise RuntimeError("no profile is running on this rank")
        prof, self.active = self.active, None
        device_mod.synchronize(device_mod.detect())  # the wall time ends with the device's queue
        wall_seconds = time.perf_counter() - self.started
        prof.stop()
        stem = Path(stem)
        stem.parent.mkdir(parents=True, exist_ok=True)
        device = device_mod.gpu_available()
        events = prof.events()
        text = profile_tables(prof.key_averages(), device=device, wall_seconds=wall_seconds,
                              busy_seconds=device_busy_seconds(events) if device else None,
                              calls=region_calls(events))
        (stem.parent / f"{stem.name}.txt").write_text(text)  # first: the trace of a big step takes longer
        if trace:
            prof.export_chrome_trace(str(stem.parent / f"{stem.name}.json.gz"))
        return str(stem.parent / f"{stem.name}.txt")


def profile_tables(averages, device: bool, wall_seconds: float | None = None,
                   busy_seconds: float | None = None, calls: list[str] | None = None) -> str:
    """The wall and device-busy times, flexrl's regions by total time (and `calls`, each region's
    calls in order: `region_calls`), then the ops with the most self time (device, else CPU; with a
    device also by CPU)."""
    lines = [] if wall_seconds is None else [_busy_line(wall_seconds, busy_seconds if device else None), ""]
    lines += region_table(averages, device) + (["", *calls] if calls else [])
    if device:
        lines += ["", averages.table(sort_by="self_device_time_total", row_limit=40),
                  "ops by self CPU time (host work between the kernels):",
                  averages.table(sort_by="self_cpu_time_total", row_limit=25)]
    else:
        lines += ["", averages.table(sort_by="self_cpu_time_total", row_limit=40)]
    return "\n".join(lines) + "\n"


def _on_device(event) -> bool:
    """A kernel or copy on the device (not a CPU op, nor a region's span that the profiler also
    places on the device's timeline)."""
    from torch.autograd import DeviceType

    return event.device_type != DeviceType.CPU and not getattr(event, "is_user_annotation", False)


def device_busy_seconds(events) -> float:
    """Seconds in which at least one kernel or copy ran on the device: the union of their
    intervals, so streams running at once (communication beside compute) count once."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if _on_device(e))
    busy, reached = 0.0, float("-inf")
    for start, end in spans:
        if end > reached:
            busy += end - max(start, reached)
            reached = end
    return busy / 1e6


def _busy_line(wall_seconds: float, busy_seconds: float | None) -> str:
    line = f"profiled {wall_seconds:.2f} s of wall time"
    if busy_seconds is not None:
        line += (f"; the device ran kernels or copies during {busy_seconds:.2f} s of it "
                 f"({busy_seconds / max(wall_seconds, 1e-9):.0%}; the rest it waited for the host)")
    return line


def region_table(averages, device: bool) -> list[str]:
    """One row per flexrl region: calls, CPU total and, with a device, the device time of the
    kernels launched inside it and the span from its first kernel's start to its last one's end
    (the profiler reports the two as two events: merged here). Kernels well under the span: the
    device waited for the host inside the region."""
    from torch.autograd import DeviceType

    merged: dict[str, list[float]] = {}
    for event in averages:
        if event.key.startswith(PREFIX):
            row = merged.setdefault(event.key, [0, 0.0, 0.0, 0.0])
            row[0] = max(row[0], event.count)
            if event.device_type != DeviceType.CPU:
                row[3] = max(row[3], event.device_time_total / 1e3)  # the span on the device's timeline
            else:
                row[1] = max(row[1], event.cpu_time_total / 1e3)
                row[2] = max(row[2], event.device_time_total / 1e3)  # kernels launched inside
    order = sorted(merged.items(), key=lambda item: -(item[1][3] if device else item[1][1]))
    header = f"{'flexrl region':<32} {'calls':>6} {'CPU total ms':>13}"
    lines = [header + (f" {'kernels ms':>12} {'device span ms':>15}" if device else "")]
    for key, (calls, cpu_ms, kernel_ms, span_ms) in order:
        line = f"{key:<32} {calls:>6} {cpu_ms:>13.1f}"
        lines.append(line + (f" {kernel_ms:>12.1f} {span_ms:>15.1f}" if device else ""))
    return lines


def region_calls(events, shown: int = 16) -> list[str]:
    """Each flexrl region's calls in the order they ran, as host wall milliseconds each (the first
    `shown`): which call of a region took the time, e.g. the reference pass's vision tower against
    the old policy's. Indented, so that a line never starts with the region's name."""
    from torch.autograd import DeviceType

    spans: dict[str, list[float]] = {}
    for event in sorted((e for e in events if e.name.startswith(PREFIX) and e.device_type == DeviceType.CPU),
                        key=lambda e: e.time_range.start):
        spans.setdefault(event.name, []).append(event.time_range.elapsed_us() / 1e3)
    lines = ["each region's calls in order, host wall ms:"] if spans else []
    for name, each in spans.items():
        more = f" ... ({len(each)} calls)" if len(each) > shown else ""
        lines.append(f"  {name}: " + ", ".join(f"{ms:.1f}" for ms in each[:shown]) + more)
    return lines


SYNC_METHODS = frozenset({"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy"})
"""Tensor methods that wait for the device's result (on a GPU: each drains the queue the host had built ahead)."""


class SyncCounter(TorchFunctionMode):
    """Counts the calls of `SYNC_METHODS` on tensors while active, by method name (on any device: a CPU
    run counts what a GPU run would wait for). Blocking host-to-device copies also wait on a GPU and are
    not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))
