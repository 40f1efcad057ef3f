"""A Ray actor that died, said in one line a user can act on.

Ray reports a worker it lost as a `RayActorError` (or `OutOfMemoryError`) whose text is dozens of
lines: when its memory monitor kills a worker because the node's host memory ran low, the text is a
table of processes and a tuning guide, and the reason is buried in it. `lost_worker_error` turns
such an error into a `RuntimeError` naming the call, what happened and, for a memory kill, what of
the run lives in host memory, or that no setting puts anything there (`memory_hint`); Ray's text
stays attached as its cause (nothing lost).
An exception raised by the worker's own code is not a lost worker and passes unchanged.
"""

from __future__ import annotations

from typing import NoReturn

from flexrl_ds.common import RunInputError
from flexrl_ds.runtime.host_memory import ray_kill_share

MEMORY_KILL_WORDS = ("low on memory", "memory monitor", "out of memory issue", "memory_usage_threshold",
                     "based on the killing policy")
"""Phrases of Ray's message when its memory monitor killed the worker (matched case-insensitively)."""


RAY_GENERIC_ADVICE = " Some common causes include"
"""Where Ray's account of a dead worker turns to the list of causes it gives every time (the OOM
killer, `ray stop --force`, a crash): cut from the one line, kept in the attached report."""
DETAIL_CHARS = 240
"""The most of Ray's account of a death the one line carries."""


def killed_for_host_memory(error: BaseException) -> bool:
    """Whether Ray lost the worker because its memory monitor killed it (host memory ran low)."""
    import ray

    if isinstance(error, ray.exceptions.OutOfMemoryError):
        return True
    text = str(error).lower()
    return isinstance(error, ray.exceptions.RayActorError) and any(word in text for word in MEMORY_KILL_WORDS)


def lost_worker_error(error: BaseException, what: str, memory_hint: str = "") -> RuntimeError | None:
    """The short account of `error` for call `what` (e.g. "policy.train_step"), or None when
    `error` is not a lost worker (the worker's own exception, a timeout): `raise_lost_worker`."""
    import ray

    if killed_for_host_memory(error):
        return RuntimeError(
            f"{what}: Ray's memory monitor killed a worker because its node ran low on host memory (Ray "
            f"kills above {ray_kill_share():.0%} of the node's memory, RAY_memory_usage_threshold)"
            + (f". {memory_hint}" if memory_hint else "") + ". Ray's report is above.")
    if isinstance(error, ray.exceptions.RayActorError):
        return RuntimeError(f"{what}: a worker died ({death_detail(error)}); its log in Ray's session folder "
                            "(/tmp/ray/session_latest/logs on its node) says why. Ray's report is above.")
    return None


def death_detail(error: BaseException) -> str:
    """What Ray says of a dead actor beyond its fixed first line: its own message (e.g. "The actor's
    worker process exited: SIGSEGV") and its node's address, where Ray gives them."""
    lines = str(error).splitlines()
    fields = dict(line.strip().split(": ", 1) for line in lines[1:] if line.startswith("\t") and ": " in line)
    message = next((line.strip() for line in lines[1:] if line.strip() and not line.startswith("\t")), "")
    message = message.split(RAY_GENERIC_ADVICE)[0].strip()  # Ray's list of possible causes: in the report
    if len(message) > DETAIL_CHARS:
        message = message[:DETAIL_CHARS - 3] + "..."
    parts = [message or (lines[0].strip() if lines else type(error).__name__)]
    if "ip" in fields:
        parts.append(f"on {fields['ip']}")
    return " ".join(parts)


def raise_lost_worker(error: BaseException, what: str, memory_hint: str = "") -> NoReturn:
    """Raise `error`'s short account with `error` as its cause, or `error` itself if it has none."""
    explained = lost_worker_error(error, what, memory_hint)
    if explained is None:
        raise error
    raise explained from error


def raise_as_the_worker_raised(error: BaseException) -> NoReturn:
    """Raise a worker's error: its `RunInputError` (the run's own input, said in one line, e.g.
    trainer/device_oom.py's) as the worker raised it, without Ray's wrapper; anything else as it is."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, RunInputError):
        raise cause from None
    raise error


def ray_get_explained(refs: list, what: str, timeout_s: float | None = None, memory_hint: str = "") -> list:
    """`ray.get(refs)`, a worker Ray lost raised as its one-line account (`raise_lost_worker`), and a
    worker's `RunInputError` (e.g. trainer/device_oom.py's) as the worker raised it."""
    import ray

    try:
        return ray.get(refs, timeout=timeout_s)
    except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as error:
        raise_lost_worker(error, what, memory_hint)
    except ray.exceptions.RayTaskError as error:
        raise_as_the_worker_raised(error)
