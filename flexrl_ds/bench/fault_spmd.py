"""The SPMD launcher's whole-run case of `flexrl bench faults` (bench/faults.py), marked slow.

`scripts/train_deepspeed.sh` starts 2 policy ranks on this machine (`deepspeed --hostfile`, rank 0
drives, engines inside the ranks) on bench/fault_train.py's tiny model, data and config; rank 1's
process is SIGKILLed after step 1. DeepSpeed's launcher then stops the other rank (SIGTERM) and exits
with an error; rank 0 must have named the lost rank, its pid and the step, and the checkpoint to
resume from (runtime/spmd_failures.py): in its group call's error where that fails first, else in
the line it says on the launcher's SIGTERM. The run is then resumed with `--resume` under the same
launcher and must equal the uninterrupted run (bench/fault_train.py's reference, on Ray: both
launchers run the same trainer and seeds) in sample ids, responses, metrics and parameters.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

from flexrl_ds.bench.fault_train import (ROOT, STEPS, _assets, _kill_session, _steps_done, _wait_for, compare_runs,
                                         reference)
from flexrl_ds.bench.faults import Case, Observed


def _launch(assets: Path, out: Path, port: int, resume: bool = False) -> subprocess.Popen:
    hostfile = out.parent / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    out.mkdir(parents=True, exist_ok=True)
    argv = ["bash", str(ROOT / "scripts" / "train_deepspeed.sh"), str(hostfile), str(assets / "run.json"),
            "--model", str(assets / "model"), "--data", str(assets / "data" / "train.jsonl"), "--out", str(out),
            "--max-steps", str(STEPS)] + (["--resume"] if resume else [])
    env = {**{k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MASTER_ADDR")},
           "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT)}
    log = open(out.parent / f"spmd{'.resume' if resume else ''}.log", "w")
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(child: subprocess.Popen, timeout_s: float = 1200.0) -> int:
    try:
        return child.wait(timeout=timeout_s)
    finally:
        _kill_session(child)


def _rank_pid(child: subprocess.Popen, rank: int) -> int | None:
    """The pid of the run's process whose RANK is `rank` (a flexrl train --spmd process)."""
    import psutil

    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getsid(process.pid) != child.pid or "--spmd" not in (process.info["cmdline"] or []):
                continue
            if process.environ().get("RANK") == str(rank):
                return process.pid
        except (psutil.Error, ProcessLookupError):
            continue
    return None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _spmd_rank_killed(folder: Path) -> Observed:
    reference_out, assets, out = reference(folder.parent), _assets(folder.parent), folder / "run"
    child = _launch(assets, out, _free_port())
    _wait_for(lambda: _steps_done(out) >= 1 and (out / "checkpoints" / "step_0").is_dir()
              and _rank_pid(child, 1) is not None, child)
    victim = _rank_pid(child, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    injected = time.perf_counter()
    code = _finish(child)
    detect = time.perf_counter() - injected
    log = (folder / "spmd.log").read_text(errors="replace")
    named = re.search(rf"rank 1 \(pid {victim}\) died", log)
    survivor = re.search(r"rank 0 \(survivor\) (failed|stopped) at step \d+ \(0-based \d+\) after losing rank 1", log)
    resumable = f"--resume, from {out / 'checkpoints'}" in log
    seen = (f"launcher exit {code} after {detect:.1f} s; " + (named.group(0) if named else "no line naming rank 1")
            + f"; {survivor.group(0) if survivor else 'no survivor line'}; resumable: {resumable}")
    if code == 0 or not named or not survivor or not resumable:
        return Observed(seen, False, detect_s=detect)
    started = time.perf_counter()
    resumed = _finish(_launch(assets, out, _free_port(), resume=True))
    recover = time.perf_counter() - started
    differences, lost, duplicated = compare_runs(reference_out, out)
    steps = differences[0] if differences and differences[0].startswith("metrics.jsonl steps") else "all steps once"
    seen += (f"; --resume: exit {resumed}, {steps}; against the uninterrupted Ray run: {len(differences)} "
             f"difference(s) ({'; '.join(differences[:2]) or 'none'})")
    passed = resumed == 0 and not differences and not lost and not duplicated
    return Observed(seen, passed, lost, duplicated, detect, recover)


CASES = [
    Case("train:spmd_rank_killed", "policy rank 1 of a `deepspeed --hostfile` run (scripts/train_deepspeed.sh, 2 "
         "ranks on this machine) SIGKILLed after step 1", "rank 0 names the lost rank (its pid) and the step, and the "
         "checkpoint to --resume from, before the launcher stops it; --resume under the launcher equals the "
         "uninterrupted run, 0 samples lost or duplicated", _spmd_rank_killed, slow=True),
]
