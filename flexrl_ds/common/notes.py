"""Lines a worker process says to whoever runs the job.

`say(line)` logs the line at INFO through the `flexrl_ds.common` logger (common/logs.py: the console,
at FLEXRL_LOG_LEVEL), as the process would print it; at a quieter level it is neither shown nor
kept. That reaches a person in a launcher's
processes (`deepspeed --hostfile`, torchrun), but not in a Ray actor: the drivers join Ray with
`log_to_driver=False`, so that the ranks' own output (DeepSpeed's, transformers', vLLM's) stays in
their log files (/tmp/ray/session_latest/logs on each node). So a Ray actor's body that hosts a
worker derives from `NoteKeeper`, which calls `keep()`; from then on its said lines are also kept,
and they go back to the driver with each call's result (or, after a failed call or one whose
references the caller waits for itself, through `take_notes`), which prints them
(runtime/worker_group.RayWorkerGroup._get, print_worker_notes).
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__package__)
_lock = threading.Lock()
_kept: list[str] | None = None
"""Lines said since the driver last took them; None where nothing keeps them (no Ray actor)."""


def say(line: str, console: bool = True) -> None:
    """Log `line` here at INFO, and keep it for the driver where this process is a Ray actor's.
    `console=False`: only here (e.g. every rank but 0 of a line all ranks would say alike). At a log
    level above INFO the line is dropped: the driver, at the same level, would not show it."""
    if not logger.isEnabledFor(logging.INFO):
        return
    logger.info(line)
    with _lock:
        if _kept is not None and console:
            _kept.append(line)


def keep() -> None:
    """From now on keep said lines until `take` (a Ray actor's body calls it once)."""
    global _kept
    with _lock:
        if _kept is None:
            _kept = []


def take() -> list[str]:
    """The lines kept since the last call, oldest first; they are not kept any longer."""
    with _lock:
        if not _kept:
            return []
        lines = list(_kept)
        _kept.clear()
        return lines


class NoteKeeper:
    """Base of a Ray actor's body: keeps the process's said lines from construction on, and hands
    them to the driver (`take_notes`, called by runtime/worker_group.print_worker_notes). List it
    first among the bases: it passes the arguments on to the next class's constructor, and a host
    class that does not call `super().__init__` would otherwise leave `keep()` uncalled."""

    def __init__(self, *args, **kwargs):
        keep()
        super().__init__(*args, **kwargs)

    def take_notes(self) -> list[str]:
        return take()
