"""Where a run keeps its state: checkpoints/step_N (DeepSpeed + trainer state), hf/step_N exports.

`checkpoints/step_N/` holds the policy's DeepSpeed checkpoint (tag "policy", written by every rank;
under ZeRO-3 each rank's model-states file carries that rank's torch / numpy / Python RNG states in
its client state, `rng_<rank>`) and `trainer_state.json`: the
step it ends, the loader position (steps drawn), the run config it was written with and the size of
every other file of the folder (`files`). The driver draws no random numbers: every sampling seed
derives from (seed, step, slot, k).

A checkpoint is written to `checkpoints/step_N.partial` and renamed to `step_N` once its
trainer_state.json, written last, is in it (`write_checkpoint`): a crash during a save leaves a
`.partial` folder that no resume reads. A save that fails (the disk full: one clear line,
`CheckpointNotWritten`) removes its partial folder and leaves the previous checkpoints as they were.
`latest_checkpoint(out)` finds the newest complete one; `resume_checkpoint(out)` also says which newer
ones it passed over and why (no trainer state, a file missing or shorter than when it was written).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flexrl_ds.common.json_files import read_json

STATE_FILE = "trainer_state.json"


@dataclass(frozen=True)
class RunPaths:
    """The output folders of one run."""

    out_dir: Path

    def checkpoint(self, step: int) -> Path:
        return self.out_dir / "checkpoints" / f"step_{step}"

    def hf_export(self, step: int) -> Path:
        return self.out_dir / "hf" / f"step_{step}"

    def rollouts(self, step: int) -> Path:
        return self.out_dir / "rollouts" / f"step_{step}.jsonl"

    def plan(self, step: int, suffix: str = "") -> Path:
        path = self.out_dir / "plans" / f"step_{step}{suffix}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path


def write_trainer_state(directory: Path, step: int, loader_steps: int, run_config: dict[str, Any]) -> None:
    """trainer_state.json, with the size of every other file of `directory` (`files`), written to a
    temporary name and renamed: a reader finds it whole or not at all."""
    files = {str(path.relative_to(directory)): path.stat().st_size for path in sorted(directory.rglob("*"))
             if path.is_file() and path.name != STATE_FILE}
    state = {"step": step, "loader_steps": loader_steps, "run_config": run_config, "files": files}
    temporary = directory / f".{STATE_FILE}.tmp"
    with open(temporary, "w") as file:
        file.write(json.dumps(state, indent=1))
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, directory / STATE_FILE)


def read_trainer_state(directory: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint; ValueError naming the file if it has no step number."""
    path = directory / STATE_FILE
    state = read_json(path, "trainer state")
    if not isinstance(state, dict) or type(state.get("step")) is not int:
        raise ValueError(f"{path}: no integer 'step' in it, so {directory.name} cannot be resumed from "
                         f"(remove {directory} to resume from the checkpoint before it)")
    return state


RESUME_FREE_KEYS = ("flexrl.trainer.max_steps",)
"""Settings a resumed run may change without comment: giving a finished run more steps is how it goes on."""


def changed_settings(saved: Any, now: Any, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two configs, each as "key (old -> new)"; a key only
    one of them has reads "(unset)" on the other side."""
    if isinstance(saved, dict) and isinstance(now, dict):
        changes = []
        for key in sorted(set(saved) | set(now), key=str):
            dotted = f"{prefix}.{key}" if prefix else str(key)
            if key not in saved or key not in now:
                old, new = (json.dumps(saved[key]) if key in saved else "(unset)",
                            json.dumps(now[key]) if key in now else "(unset)")
                changes.append(f"{dotted} ({old} -> {new})")
            else:
                changes += changed_settings(saved[key], now[key], dotted)
        return changes
    return [] if saved == now else [f"{prefix} ({json.dumps(saved)} -> {json.dumps(now)})"]


RESTORED_BLOCKS = ("optimizer.", "scheduler.")
"""Config blocks whose values DeepSpeed's checkpoint brings back with the optimizer's and scheduler's
state (learning rate, betas, eps, weight decay, the schedule's position): changing them for a resumed
run may do nothing."""


def resume_config_note(saved: dict, now: dict) -> str:
    """What a resumed run changes of the config its checkpoint was written under ("" when nothing
    that matters): it goes on with the new values, so it no longer reproduces the uninterrupted run;
    except where the checkpoint restores them (RESTORED_BLOCKS)."""
    free = tuple(f"{key} (" for key in RESUME_FREE_KEYS)
    changes = [change for change in changed_settings(saved, now) if not change.startswith(free)]
    restored = [change for change in changes if change.startswith(RESTORED_BLOCKS)]
    applied = [change for change in changes if not change.startswith(RESTORED_BLOCKS)]
    lines = []
    if applied:
        lines.append(f"--resume: the config differs from the one the checkpoint was written under: {_shown(applied)}. "
                     "The run goes on with the new values, so it will not reproduce the uninterrupted run.")
    if restored:
        lines.append(f"--resume: changed since the checkpoint: {_shown(restored)}. DeepSpeed restores the "
                     "optimizer's and scheduler's state from the checkpoint (learning rate, betas, eps, weight "
                     "decay, the schedule's position), so these changes may have no effect.")
    return "\n".join(lines)


def _shown(changes: list[str]) -> str:
    return "; ".join(changes[:8]) + (f"; and {len(changes) - 8} more" if len(changes) > 8 else "")


def check_out_dir(out_dir: Path, resume: bool) -> None:
    """A run without --resume starts in a folder that holds no other run's steps: it would rewrite
    metrics.jsonl over them and leave their checkpoints, which a later --resume would continue from."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--out {out_dir}: is a file; --out names the run's folder")
    if resume:
        return
    metrics = out_dir / "metrics.jsonl"
    checkpoints = out_dir / "checkpoints"
    held = [metrics.name] if metrics.is_file() and metrics.stat().st_size else []
    if checkpoints.is_dir():
        held += sorted(f"checkpoints/{path.name}" for path in checkpoints.glob("step_*"))
    if held:
        shown = ", ".join(held[:4]) + (" ..." if len(held) > 4 else "")
        advice = ("pass --resume to continue it" if latest_checkpoint(out_dir) is not None else
                  "it has no complete checkpoint, so --resume would start over at step 0 in it")
        raise ValueError(f"--out {out_dir} already holds a run ({shown}): {advice}, or choose another --out "
                         "(or remove that one)")


def checkpoint_problem(directory: Path) -> str | None:
    """Why checkpoint folder `directory` cannot be resumed from (a crash or a full disk during its
    save, a copy cut short), or None when it is complete: its trainer state readable, and every file
    that state lists there at the size it was written (states written before sizes were kept: their
    presence is enough)."""
    path = directory / STATE_FILE
    if not path.is_file():
        return f"no {STATE_FILE} (written last: the save did not finish)"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return f"{STATE_FILE} unreadable ({error})"
    if not isinstance(state, dict):
        return f"{STATE_FILE} holds no object"
    # a state without an integer step is no crash's leftover (the file is renamed into place whole):
    # `read_trainer_state` refuses it, naming the file
    for name, size in (state.get("files") or {}).items():
        file = directory / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} when written (truncated)"
    return None


def _step_folders(out_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoints/step_N folder, highest step first."""
    root = out_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = re.fullmatch(r"step_(\d+)", path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def resume_checkpoint(out_dir: Path) -> tuple[Path | None, list[str]]:
    """The complete checkpoint of the highest step under OUT/checkpoints (or None), and one line for
    each newer folder passed over: "step_N: why" (`checkpoint_problem`)."""
    passed_over: list[str] = []
    for _, path in _step_folders(out_dir):
        problem = checkpoint_problem(path)
        if problem is None:
            return path, passed_over
        passed_over.append(f"{path.name}: {problem}")
    return None, passed_over


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The complete checkpoint of the highest step under OUT/checkpoints, or None."""
    return resume_checkpoint(out_dir)[0]


class CheckpointNotWritten(ValueError):
    """A checkpoint's save failed for want of disk space: one line (a ValueError, so `flexrl` prints it
    without a traceback) naming the folder, the reason and the checkpoint a --resume would use."""


def is_disk_full(error: BaseException) -> bool:
    """Whether `error`, or an error it was raised from (Ray's `cause` of a worker's exception included),
    is the disk full (ENOSPC, EDQUOT)."""
    seen: set[int] = set()
    stack: list[Any] = [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(current) or "Disk quota exceeded" in str(current):
            return True
        stack += [current.__cause__, current.__context__, getattr(current, "cause", None)]
    return False


@contextlib.contextmanager
def disk_full_explained(what: str):
    """Run the block; a full disk in it is raised as `CheckpointNotWritten` naming `what`."""
    try:
        yield
    except Exception as error:
        if not is_disk_full(error):
            raise
        raise CheckpointNotWritten(f"{what}: the disk is full (no space left on device); free space, "
                                   "then --resume") from error


def write_checkpoint(final: Path, write: Callable[[Path], object], state: Callable[[Path], None]) -> None:
    """Write a checkpoint atomically (module docstring): `write(folder)` fills FINAL.partial (every
    rank's files), `state(folder)` adds its trainer state, then the folder is renamed to `final` (an
    older folder of that name replaced). On failure the partial folder is removed; a full disk raises
    `CheckpointNotWritten`, other errors pass unchanged."""
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a crashed save's leftovers
    try:
        partial.mkdir(parents=True)
        write(partial)
        state(partial)
    except BaseException as error:
        shutil.rmtree(partial, ignore_errors=True)
        if not isinstance(error, Exception) or not is_disk_full(error):
            raise
        previous = latest_checkpoint(final.parent.parent)
        kept = f"{previous.name} is intact, --resume continues from it" if previous else "no earlier checkpoint"
        raise CheckpointNotWritten(f"checkpoint {final.name}: the disk is full (no space left on device) while "
                                   f"writing {partial}: it was removed; {kept}. Free space, then "
                                   "--resume") from error
    replaced = final.with_name(final.name + ".replaced")
    if final.exists():
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(final, replaced)
    os.replace(partial, final)
    shutil.rmtree(replaced, ignore_errors=True)
