"""A group call on which some ranks were lost: which ones, and what each survivor saw.

`wait_ranks(refs, what, timeout_s, collective_timeout_s)` waits for one call on every rank of a Ray
worker group. All answer: their results. A rank's actor dies (Ray's `RayActorError`: killed, a
crash, the memory monitor) or a rank's own code raises (a survivor's collective failed: its peer
closed the connection, or the process group's timeout, `flexrl.trainer.collective_timeout_s`,
passed while a peer stalled): once any rank has answered or failed, the others are given that
timeout and `GRACE_S` more to answer or fail too (a rank that stalls in a call holding no collective
is caught the same way), then `LostRanks` is raised: the ranks lost (dead, or stalled: neither answering
nor failing while the others failed), and one line per survivor naming the lost ranks and what it
raised. The driver adds the step and the checkpoint to resume from (`LostRanks.at`). A call where no
rank failed but not all answered within `timeout_s` names the silent ranks the same way.
"""

from __future__ import annotations

import time
from typing import Any
from dataclasses import dataclass, field, replace

from flexrl_ds.runtime.lost_workers import (death_detail, killed_for_host_memory, lost_worker_error,
                                            raise_as_the_worker_raised)

GRACE_S = 5.0
"""Seconds beyond the collective timeout that the other ranks get after a first failure."""


def first_line(error: BaseException) -> str:
    """What a rank raised, in a line: the innermost cause Ray carries, else the error itself."""
    cause = getattr(error, "cause", None) or error
    text = next((line.strip() for line in str(cause).splitlines() if line.strip()), "")
    return f"{type(cause).__name__}: {text[:300]}"


@dataclass
class LostRanks(RuntimeError):
    """Some ranks of a group were lost during a call (module docstring)."""

    what: str
    """The call, e.g. "policy.train"."""
    lost: dict[int, str]
    """Rank -> how it was lost ("died: ...", "stalled: ...")."""
    survivors: dict[int, str] = field(default_factory=dict)
    """Rank -> what it raised (its collective's failure)."""
    waited_s: float = 0.0
    """Seconds from the call's start until the last survivor had failed."""
    step: int | None = None
    """The training step (0-based) the call belonged to, once the driver knows it."""
    resume_from: str | None = None
    """The checkpoint a --resume would continue from ("" when there is none)."""
    headline: str = ""
    """Ranks that died with no survivor failing: runtime/lost_workers.py's one line, with the ranks."""
    answered: list[int] = field(default_factory=list)
    """Ranks that answered the call (it held no collective with the lost rank): stopped with the run."""

    def __post_init__(self) -> None:
        super().__init__(self.what)

    def __str__(self) -> str:
        return self.message()

    def at(self, step: int, resume_from: str) -> "LostRanks":
        """This failure with the step it happened in and the checkpoint to resume from."""
        return replace(self, step=step, resume_from=resume_from)

    def message(self) -> str:
        if self.headline and self.step is None:
            return self.headline
        where = f" at step {self.step + 1} (0-based {self.step})" if self.step is not None else ""
        names = ", ".join(f"rank {rank}" for rank in sorted(self.lost))
        lines = [f"{self.what}{where}: lost {names}: " + "; ".join(f"rank {rank} {how}" for rank, how in
                                                                    sorted(self.lost.items()))]
        for rank, seen in sorted(self.survivors.items()):
            lines.append(f"  rank {rank} (survivor) failed{where} after losing {names}: {seen}")
        for rank in self.answered:
            lines.append(f"  rank {rank} (survivor) stopped{where} after losing {names}: it had answered "
                         f"{self.what}, which holds no collective; the run ends it")
        if self.survivors:
            lines.append(f"  every survivor failed within {self.waited_s:.1f} s of the call's start")
        if self.resume_from is not None:
            lines.append(f"  the run can go on with --resume, from {self.resume_from}" if self.resume_from else
                         "  no checkpoint was written yet: --resume would start over")
        return "\n".join(lines)


def _outcome(ray, ref) -> tuple[str, object]:
    """("ok", result) | ("died", the error) | ("raised", the error) of a finished call."""
    try:
        return "ok", ray.get(ref)
    except (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError) as error:
        return "died", error
    except Exception as error:  # the rank's own exception (RayTaskError): a survivor's failure
        return "raised", error


def wait_ranks(refs: list, what: str, timeout_s: float, collective_timeout_s: float,
               memory_hint: str = "", pids: list[int] | None = None) -> list:
    """Every rank's result of one call, in rank order; `LostRanks` (module docstring). `pids`: each
    rank's process id, named with a lost rank (its log, `ray list actors`). No rank answering within
    `timeout_s` is a hang, not a lost rank: RuntimeError."""
    import ray

    start, first_failure, first_answer = time.monotonic(), None, None
    outcomes: dict[int, Any] = {}
    finished: dict[Any, Any] = {}
    deadline = start + timeout_s
    while len(outcomes) < len(refs):
        pending = [ref for rank, ref in enumerate(refs) if rank not in outcomes]
        ready, _ = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for ref in ready:
            rank = refs.index(ref)
            outcomes[rank], finished[rank] = _outcome(ray, ref), time.monotonic()
        if first_answer is None:  # the others get the collective timeout: longer, and one of them stalled
            first_answer = time.monotonic()
            deadline = min(deadline, first_answer + collective_timeout_s + GRACE_S)
        if first_failure is None and any(kind != "ok" for kind, _ in outcomes.values()):
            first_failure = time.monotonic()
    if len(outcomes) == len(refs) and all(kind == "ok" for kind, _ in outcomes.values()):
        return [outcomes[rank][1] for rank in range(len(refs))]
    if not outcomes:
        raise RuntimeError(f"{what}: no answer from every rank within {timeout_s:.0f} s (a hang or a crash on some "
                           "rank)")
    since = first_failure or first_answer or start
    lost = _raise_lost(refs, outcomes, finished, (start, since), what, timeout_s, memory_hint)
    if pids:
        lost.lost = {rank: f"(pid {pids[rank]}) {how}" for rank, how in lost.lost.items()}
    raise lost


def _raise_lost(refs, outcomes, finished, times, what, timeout_s, memory_hint) -> "LostRanks":
    """The `LostRanks` of a call some of whose ranks failed or stayed silent (its cause: a death's
    error); an error of the ranks' own code, no rank lost, is raised as it is."""
    start, since = times
    silent_s = time.monotonic() - since
    deaths = {rank: error for rank, (kind, error) in outcomes.items() if kind == "died"}
    lost = {rank: _death(error, memory_hint) for rank, error in deaths.items()}
    stalled = f"stalled: no answer {silent_s:.0f} s after the first rank's answer or failure" if outcomes else \
        f"stalled: no answer within {timeout_s:.0f} s"
    lost.update({rank: stalled for rank in range(len(refs)) if rank not in outcomes})
    survivors = {rank: first_line(error) for rank, (kind, error) in outcomes.items() if kind == "raised"}
    if not lost:  # every failing rank's own code raised: no rank was lost, the first error as it is
        raise_as_the_worker_raised(next(error for kind, error in outcomes.values() if kind == "raised"))
    waited = max((finished[rank] - start for rank in survivors), default=0.0)
    headline = ""
    if not survivors and not answered_any(outcomes) and len(deaths) == len(lost):  # every rank died: the line of old
        first = deaths[min(deaths)]
        ranks = ", ".join(f"rank {r}" for r in sorted(lost))
        headline = f"{lost_worker_error(first, what, memory_hint)} Lost: {ranks}."
    answered = sorted(rank for rank, (kind, _) in outcomes.items() if kind == "ok")
    failure = LostRanks(what, lost, survivors, waited, headline=headline, answered=answered)
    failure.__cause__ = deaths[min(deaths)] if deaths else None
    return failure


def is_lost_worker(error: BaseException) -> bool:
    """Whether `error` is a worker lost: `LostRanks`, or an error raised from one Ray lost (a rollout
    engine's death said by runtime/lost_workers.py), anywhere in its chain of causes."""
    import ray

    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, (LostRanks, ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError)):
            return True
        error, seen = error.__cause__, seen + 1
    return False


def lost_at_step(error: BaseException, step: int, resume_from: str) -> BaseException:
    """A lost worker's error said with the step (0-based) and the checkpoint --resume would use ("": none)."""
    if isinstance(error, LostRanks):
        return error.at(step, resume_from)
    return RuntimeError(f"{error} At step {step + 1} (0-based {step}); " + (
        f"the run can go on with --resume, from {resume_from}" if resume_from else
        "no checkpoint was written yet: --resume would start over"))


def answered_any(outcomes: dict) -> bool:
    return any(kind == "ok" for kind, _ in outcomes.values())


def _death(error: BaseException, memory_hint: str) -> str:
    if killed_for_host_memory(error):
        hint = f"; {memory_hint}" if memory_hint else ""
        return f"died: Ray's memory monitor killed it (host memory ran low){hint}"
    return f"died: {death_detail(error)}"
