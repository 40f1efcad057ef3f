"""Where a policy rank's step time goes: torch.profiler over chosen phases, and flexrl's own regions.

`region(name)` marks a part of a pass ("flexrl/forward", "flexrl/backward", ...; inside a forward,
"flexrl/vision_tower", "flexrl/decoder" and "flexrl/lm_head") for the profiler;
it costs next to nothing while no profile runs. `RankProfiler.start()` / `.stop(stem)` profile
what runs in between (CPU, and the GPU's kernels where there is one) and write:
- `<stem>.txt`: flexrl's regions by total time (what each part of the pass took, its kernels
  included), then the 40 ops with the most self time on the device (CPU without one);
- `<stem>.json.gz`: the trace, for Perfetto (ui.perfetto.dev) or chrome://tracing.
`flexrl.trainer.profile_step` asks every policy rank for one step's log-prob, update and sync phases.
Tested on CPU only: on one H200 a profiled 3B step (64 samples, 32k tokens, colocated vLLM) did not
finish in the 100 s its run had left (docs/BENCHMARKS.md "sixteenth run"); whether the profiler is
slow there or stuck next to the engine is not known yet.
"""

from __future__ import annotations

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

    def start(self) -> None:
        if self.active is not None:
            raise RuntimeError("a profile is already running on this rank")
        self.active = profile(activities=device_mod.profiler_activities())
        self.active.start()

    def stop(self, stem: str | Path) -> str:
        """End the profile; write `<stem>.txt` and `<stem>.json.gz`; returns the .txt path."""
        if self.active is None:
            raise RuntimeError("no profile is running on this rank")
        prof, self.active = self.active, None
        prof.stop()
        stem = Path(stem)
        stem.parent.mkdir(parents=True, exist_ok=True)
        text = profile_tables(prof.key_averages(), device=device_mod.gpu_available())
        (stem.parent / f"{stem.name}.txt").write_text(text)  # first: the trace of a big step takes longer
        prof.export_chrome_trace(str(stem.parent / f"{stem.name}.json.gz"))
        return str(stem.parent / f"{stem.name}.txt")


def profile_tables(averages, device: bool) -> str:
    """flexrl's regions by total time, then the ops with the most self time (device, else CPU)."""
    total = "device_time_total" if device else "cpu_time_total"
    regions = sorted((e for e in averages if e.key.startswith(PREFIX)), key=lambda e: -getattr(e, total))
    lines = [f"{'flexrl region':<32} {'calls':>6} {'CPU total ms':>13}" + (f" {'device total ms':>16}" if device else "")]
    for event in regions:
        line = f"{event.key:<32} {event.count:>6} {event.cpu_time_total / 1e3:>13.1f}"
        lines.append(line + (f" {event.device_time_total / 1e3:>16.1f}" if device else ""))
    ops = averages.table(sort_by="self_device_time_total" if device else "self_cpu_time_total", row_limit=40)
    return "\n".join(lines) + "\n\n" + ops + "\n"
