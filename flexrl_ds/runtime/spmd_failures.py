"""A launcher-started (SPMD) group that lost a rank: which one, said by each survivor with the step.

Under `deepspeed --hostfile` (or torchrun) no Ray watches the ranks. A rank that dies makes its
peers' next collective fail (gloo: the connection closed), one that stalls makes it fail at the
process group's timeout (`flexrl.trainer.collective_timeout_s`), and the launcher, seeing a rank
exit with an error, stops the other ranks of its host with SIGTERM within a second (DeepSpeed's
launcher; torchrun too, which restarts the group under its own --max-restarts).

Every rank records each rank's pid and host when the group is built (`gather_places`). A survivor
whose group call fails, or whom the launcher stops (`on_launcher_stop`), names the ranks of its host
whose process is gone (died) or stopped (stalled: SIGSTOP), and, where none is, the ranks of other
hosts, which it cannot see (`lost_peers`), with the step the group was in. Rank 0 raises `LostRanks`
(runtime/rank_failures.py), which the driver says as on the Ray path, with the step and the
checkpoint to resume from; the other survivors say their line (`survivor_line`) and exit.

What this cannot do: a rank blocked inside a device collective (NCCL waits on the GPU) does not run
Python's signal handler, and the launcher kills it after 30 s without its line; a rank whose own
code raised is named as gone like a killed one (its own output has its traceback).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class RankPlace:
    """Where one rank's process runs."""

    pid: int
    host: str


def this_place() -> RankPlace:
    return RankPlace(os.getpid(), socket.gethostname())


def gather_places(group=None) -> list[RankPlace]:
    """Every rank's place, in rank order (a collective: every rank of `group` calls it)."""
    import torch.distributed as dist

    places: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(places, this_place(), group=group)
    return places


def process_state(pid: int) -> str:
    """"gone" (no such process, or a zombie not yet reaped), "stopped" (SIGSTOP, a tracer) or "alive"."""
    import psutil

    try:
        status = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"
    if status in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
        return "gone"
    if status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
        return "stopped"
    return "alive"


def lost_peers(places: list[RankPlace], rank: int, host: str | None = None,
               state: Callable[[int], str] = process_state) -> dict[int, str]:
    """Rank -> how it was lost, as rank `rank` on `host` sees it: the ranks of its host whose process
    is gone or stopped; where there is none, those of other hosts (not visible from here); {} when
    every rank is on this host and running (no rank lost: a failure of the ranks' own)."""
    host = host or socket.gethostname()
    lost = {}
    for other, place in enumerate(places):
        if other != rank and place.host == host:
            how = state(place.pid)
            if how == "gone":
                lost[other] = f"(pid {place.pid}) died: its process is gone"
            elif how == "stopped":
                lost[other] = f"(pid {place.pid}) stalled: its process is stopped"
    if lost:
        return lost
    return {other: f"(pid {place.pid} on {place.host}) not visible from {host}: died or stalled"
            for other, place in enumerate(places) if other != rank and place.host != host}


SETTLE_S = 3.0
"""Seconds a survivor whose collective failed gives a dying peer to read as gone (`lost_peers_settled`)."""


def lost_peers_settled(places: list[RankPlace], rank: int, within_s: float = SETTLE_S, host: str | None = None,
                       state: Callable[[int], str] = process_state) -> dict[int, str]:
    """`lost_peers` after a failed collective, asked again until a lost rank shows or `within_s` passed.

    A killed process closes its sockets before the kernel marks it a zombie, so the peer whose
    collective failed on the closed connection can look at it while it still reads as running."""
    deadline = time.monotonic() + within_s
    while not (lost := lost_peers(places, rank, host, state)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return lost


def where(step: int | None) -> str:
    return f" at step {step + 1} (0-based {step})" if step is not None else " before the first step"


def survivor_line(rank: int, step: int | None, lost: dict[int, str], seen: str, stopped: bool = False,
                  resume_from: str | None = None) -> str:
    """A survivor's line, as the Ray path's (runtime/rank_failures.LostRanks); `resume_from`: the
    checkpoint a --resume would continue from ("": none yet; None: not known here)."""
    verb = "stopped" if stopped else "failed"
    resume = "" if resume_from is None else (f"; the run can go on with --resume, from {resume_from}" if resume_from
                                              else "; no checkpoint was written yet: --resume would start over")
    if not lost:
        return f"rank {rank} {verb}{where(step)}: {seen} (no rank lost that it can see){resume}"
    names = ", ".join(f"rank {other}" for other in sorted(lost))
    detail = "; ".join(f"rank {other} {how}" for other, how in sorted(lost.items()))
    return f"rank {rank} (survivor) {verb}{where(step)} after losing {names}: {seen} [{detail}]{resume}"


def on_launcher_stop(say: Callable[[], str]) -> None:
    """On SIGTERM (the launcher stopping the ranks after one failed), print `say()`'s line and exit
    at once with 143: no clean-up that would wait in a collective for the lost rank (the launcher
    ends the process tree, a local Ray with it). Must be called in the main thread."""
    def stop(signum, frame) -> None:
        print(say(), flush=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
