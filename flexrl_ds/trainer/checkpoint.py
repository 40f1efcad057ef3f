"""Where a run keeps its state: checkpoints/step_N (DeepSpeed + trainer state), hf/step_N exports.

`checkpoints/step_N/` holds the policy's DeepSpeed checkpoint (tag "policy", written by every rank;
under ZeRO-3 each rank's model-states file carries that rank's torch / numpy / Python RNG states in
its client state, `rng_<rank>`) and `trainer_state.json`: the
step it ends, the loader position (steps drawn) and the run config it was written with. The driver
draws no random numbers: every sampling seed derives from (seed, step, slot, k).
`latest_checkpoint(out)` finds the newest complete one
(a checkpoint is complete once its trainer_state.json exists: it is written last).
"""

from __future__ import annotations

import json
import re
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
    state = {"step": step, "loader_steps": loader_steps, "run_config": run_config}
    (directory / STATE_FILE).write_text(json.dumps(state, indent=1))


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


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The complete checkpoint of the highest step under OUT/checkpoints, or None."""
    root = out_dir / "checkpoints"
    if not root.is_dir():
        return None
    found = []
    for path in root.iterdir():
        match = re.fullmatch(r"step_(\d+)", path.name)
        if match and (path / STATE_FILE).exists():
            found.append((int(match.group(1)), path))
    return max(found)[1] if found else None
