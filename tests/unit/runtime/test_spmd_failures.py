"""A launcher-started (SPMD) group that loses a rank (runtime/spmd_failures.py): three real processes
joined as a launcher would start them (RANK, WORLD_SIZE, MASTER_ADDR/PORT; parallel/launch.py), rank
2 SIGKILLed or SIGSTOPped inside a group call. Rank 0's call must raise `LostRanks` naming rank 2 by
its pid (read back from the process itself) and the step; rank 1, a survivor serving rank 0's calls,
must say its line naming rank 2 and the step."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flexrl_ds.runtime import spmd_failures

ROOT = Path(__file__).resolve().parents[3]
RANK_SCRIPT = '''
import os, signal, sys, time
from flexrl_ds.parallel.launch import init_distributed
from flexrl_ds.runtime.rank_failures import LostRanks
from flexrl_ds.runtime.worker_group import SPMDWorkerGroup

class Worker:
    def pid(self):
        return os.getpid()

    def work(self, fault):
        if fault and int(os.environ["RANK"]) == 2:
            os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        return int(os.environ["RANK"])

context = init_distributed(timeout_s=float(sys.argv[2]), with_deepspeed=False, rendezvous_timeout_s=200.0)
group = SPMDWorkerGroup(Worker(), context.launch.rank, context.launch.world_size)
if context.launch.rank == 0:
    group.note_step(4)
    print("PIDS", group.run(Worker.pid), flush=True)
    group.note_step(5)
    try:
        group.run(Worker.work, sys.argv[1])
    except LostRanks as error:
        print(error.at(group.step, "checkpoints/step_4"), flush=True)
    sys.exit(3)
try:
    group.serve()
finally:  # stay a while, as under a launcher until its SIGTERM: rank 0 is to name rank 2 alone
    time.sleep(3)
'''


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank_env(rank: int, world_size: int, port: str) -> dict[str, str]:
    """A launcher's variables for one rank on this machine."""
    return {**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(rank), "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "FLEXRL_FORCE_CPU": "1",
            "OMP_NUM_THREADS": "1"}


def _run_ranks(tmp_path: Path, fault: str, timeout_s: float) -> list[str]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = str(_free_port())
    ranks = []
    for rank in range(3):
        env = _rank_env(rank, 3, port)
        ranks.append(subprocess.Popen([sys.executable, str(script), fault, str(timeout_s)], env=env, text=True,
                                      stdout=open(tmp_path / f"rank{rank}.log", "w"), stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 240
        while any(rank.poll() is None for rank in ranks[:2]) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
            rank.wait()
    return [(tmp_path / f"rank{rank}.log").read_text() for rank in range(3)]


@pytest.mark.parametrize("fault, how", [("kill", "died: its process is gone"),
                                        ("stop", "stalled: its process is stopped")])
def test_every_survivor_names_the_lost_rank_and_the_step(tmp_path, fault, how):
    logs = _run_ranks(tmp_path, fault, timeout_s=8.0)
    pids = next(line for line in logs[0].splitlines() if line.startswith("PIDS"))
    victim = eval(pids.removeprefix("PIDS "))[2]  # noqa: S307 - the list rank 0 printed
    assert f"policy.work at step 6 (0-based 5): lost rank 2: rank 2 (pid {victim}) {how}" in logs[0], logs[0]
    assert "rank 0 (survivor) failed at step 6 (0-based 5) after losing rank 2" in logs[0]
    assert "the run can go on with --resume, from checkpoints/step_4" in logs[0]
    survivor = next(line for line in logs[1].splitlines() if "(survivor)" in line)
    assert survivor.startswith("rank 1 (survivor) failed at step 6 (0-based 5) after losing "), survivor
    assert f"rank 2 (pid {victim}) {how}" in survivor


def test_a_rank_may_join_later_than_the_collective_timeout(tmp_path):
    # the rendezvous waits `rendezvous_timeout_s`, not the short collective timeout: a launcher's ranks
    # start as far apart as their imports on a busy node
    script = tmp_path / "join.py"
    script.write_text("import os, time\nimport torch, torch.distributed as dist\n"
                      "from flexrl_ds.parallel.launch import init_distributed\n"
                      "time.sleep(4.0 * int(os.environ['RANK']))\n"
                      "init_distributed(timeout_s=1.0, with_deepspeed=False, rendezvous_timeout_s=120.0)\n"
                      "total = torch.ones(1)\ndist.all_reduce(total)\nprint('SUM', int(total))\n")
    port = str(_free_port())
    ranks = [subprocess.Popen([sys.executable, str(script)], env=_rank_env(rank, 2, port), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outputs = [rank.communicate(timeout=200)[0] for rank in ranks]
    assert all("SUM 2" in output for output in outputs), outputs


def test_a_launchers_ranks_join_within_the_trainers_timeout_and_fail_collectives_within_its_collective_one(
        monkeypatch):
    from types import SimpleNamespace

    from flexrl_ds.trainer import launch
    from flexrl_ds.trainer.config import TrainerConfig

    asked = {}

    def init_distributed(**kwargs):
        asked.update(kwargs)
        raise InterruptedError("recorded")

    monkeypatch.setattr(launch, "init_distributed", init_distributed)
    trainer = TrainerConfig(timeout_s=600.0, collective_timeout_s=30.0)
    with pytest.raises(InterruptedError):
        launch.train_spmd(SimpleNamespace(flexrl=SimpleNamespace(trainer=trainer)), None, {})
    assert asked == {"timeout_s": 30.0, "rendezvous_timeout_s": 600.0}


def test_lost_peers_as_one_host_sees_them():
    places = [spmd_failures.RankPlace(10, "a"), spmd_failures.RankPlace(11, "a"), spmd_failures.RankPlace(12, "b")]
    states = {10: "alive", 11: "gone", 12: "alive"}
    assert spmd_failures.lost_peers(places, 0, "a", states.get) == {1: "(pid 11) died: its process is gone"}
    states[11] = "alive"  # nothing lost here: the other host's rank, which it cannot see
    assert spmd_failures.lost_peers(places, 0, "a", states.get) == {2: "(pid 12 on b) not visible from a: died or "
                                                                       "stalled"}
    assert spmd_failures.lost_peers(places[:2], 0, "a", states.get) == {}


def test_a_dying_peer_is_asked_again_until_it_reads_as_gone():
    # a killed rank's sockets close before the kernel marks it a zombie: the survivor whose collective
    # failed can first see it running
    places = [spmd_failures.RankPlace(10, "a"), spmd_failures.RankPlace(11, "a")]
    seen = iter(["alive", "alive", "gone"])
    assert spmd_failures.lost_peers_settled(places, 0, 5.0, "a", lambda pid: next(seen)) == {
        1: "(pid 11) died: its process is gone"}
    started = time.monotonic()
    assert spmd_failures.lost_peers_settled(places, 0, 0.2, "a", lambda pid: "alive") == {}
    assert time.monotonic() - started >= 0.2


def test_launcher_stop_says_the_line(tmp_path):
    script = ("import os, signal, time\nfrom flexrl_ds.runtime import spmd_failures\n"
              "spmd_failures.on_launcher_stop(lambda: 'LINE')\nprint('READY', flush=True)\ntime.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": str(ROOT)},
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "READY"
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == 128 + signal.SIGTERM
    assert child.stdout.read().strip() == "LINE"
