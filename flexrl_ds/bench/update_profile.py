"""`flexrl bench update --profile DIR`: one more run of each way under torch.profiler, after its timed ones.

Each way writes its own table, `DIR/<way>.txt` (parallel/profiling.py: the wall time and the device's
busy share, flexrl's regions, the ops with the most device and host time); the trace beside it
(`DIR/<way>.json.gz`) unless `--profile-tables-only` (writing the trace of a run with tens of thousands
of small kernels takes minutes on a GPU, more than a device call may have). The regions are the
per-way split of the time, the same names in every way:
- `<way>_forward_backward` (and `<way>_optimizer_step` for zero3): the whole profiled run;
- `vision_tower`: the vision tower's forward (hf ways: its module's forward hooks; inside `decoder`
  there, since transformers runs the tower inside the model's forward; flexrl ways: before `decoder`);
- `decoder`, `lm_head` (the head and the log-probs, forward), `loss` (grpo), `backward` (the whole
  backward: checkpointed layers' and chunks' recomputation included), `optimizer_step` (grpo).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

from flexrl_ds.bench.hf_baseline import vision_tower_region
from flexrl_ds.parallel import device as device_mod
from flexrl_ds.parallel.profiling import RankProfiler, region


def profile_run(info, run: Callable[[], object], profile_dir: str, name: str, trace: bool = False,
                step: Callable[[], object] | None = None, model=None) -> str:
    """One more `run` (a forward+backward) under torch.profiler in region `<name>_forward_backward`,
    then `step` (an optimizer step) in `<name>_optimizer_step` where given; with `model`, its vision
    tower's forwards marked (`vision_tower_region`). Returns the table's path (`<profile_dir>/<name>.txt`)."""
    profiler = RankProfiler()
    marks = vision_tower_region(model) if model is not None else contextlib.nullcontext()
    profiler.start()
    try:
        with marks:
            with region(f"{name}_forward_backward"):
                run()
                device_mod.synchronize(info)
            if step is not None:
                with region(f"{name}_optimizer_step"):
                    step()
                    device_mod.synchronize(info)
    except BaseException:
        profiler.discard()
        raise
    return profiler.stop(Path(profile_dir) / name, trace=trace)
