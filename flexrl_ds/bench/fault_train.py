"""Whole-run cases of `flexrl bench faults` (bench/faults.py), marked slow: they start Ray and train.

Every case runs `flexrl train` as a child process (its own session, so that the Ray it starts goes
with it) on the tiny model and a small image dataset: 2 policy ranks, 2 prompts x 2 samples a step,
3 steps, a checkpoint after every step, rollouts saved. One uninterrupted run is the reference
(shared by the cases of one scratch folder). A fault is injected from outside, as it happens in
production: the driver or a policy rank SIGKILLed, a rank SIGSTOPped (it stalls where it is, its
peers wait for it in their next collective), a preprocessing actor killed. The run is then resumed
with `--resume` where the case expects it, and compared with the reference: every step's sample
ids and responses, the metrics, the last step's weights (hf/step_2); `lost` / `duplicated` count
sample ids of the reference missing from the faulted run's steps, and sample ids trained on twice.
A rank's process is told by its pid: the driver names a lost rank's pid (runtime/rank_failures.py).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from flexrl_ds.bench.datasets import make_dataset
from flexrl_ds.bench.faults import Case, Observed
from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model
from flexrl_ds.parallel import network

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
NUM_RANKS = 2
COLLECTIVE_TIMEOUT_S = 30.0
RUN_TIMEOUT_S = 1200.0
COMPARED = ("reward_mean", "loss", "pg_loss", "kl", "grad_norm", "response_length_mean")


def _assets(scratch: Path) -> Path:
    """The tiny model, the dataset and the run config, made once per scratch folder."""
    root = scratch / "train_assets"
    if not (root / "run.json").exists():
        make_tiny_model(TinyModelConfig(out_dir=str(root / "model")))
        make_dataset(root / "data", "image-heavy", 8, "small", seed=0, task="keyword")
        config = json.loads((ROOT / "ds_configs" / "grpo_tiny_cpu.json").read_text())
        config["flexrl"]["trainer"].update(num_policy_ranks=NUM_RANKS, save_every=1, max_steps=STEPS, timeout_s=900.0,
                                           collective_timeout_s=COLLECTIVE_TIMEOUT_S, tensorboard=False)
        config["flexrl"]["data"]["loader"].update(global_batch=2, num_samples_per_prompt=2)
        config["flexrl"]["data"]["pool"].update(num_actors_per_node=2, num_cpus_per_actor=0.25)
        config["flexrl"]["sp"]["p_max"] = 2
        (root / "run.json").write_text(json.dumps(config))
    return root


def _start(assets: Path, out: Path, resume: bool = False, config: Path | None = None,
           unset: tuple[str, ...] = ()) -> subprocess.Popen:
    """`flexrl train` on the assets, writing to `out`, without the environment variables `unset`."""
    argv = [sys.executable, "-m", "flexrl_ds", "train", "--config", str(config or assets / "run.json"),
            "--model", str(assets / "model"), "--data", str(assets / "data" / "train.jsonl"), "--out", str(out),
            "--max-steps", str(STEPS)] + (["--resume"] if resume else [])
    out.mkdir(parents=True, exist_ok=True)
    log = open(out.parent / f"{out.name}{'.resume' if resume else ''}.log", "w")
    env = {**{name: value for name, value in os.environ.items() if name not in unset},
           "PYTHONPATH": os.pathsep.join([str(ROOT)] + sys.path[1:])}
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _finish(child: subprocess.Popen, timeout_s: float = RUN_TIMEOUT_S) -> int:
    try:
        return child.wait(timeout=timeout_s)
    finally:
        _kill_session(child)


def _kill_session(child: subprocess.Popen) -> None:
    """What is left of the run's session (Ray's processes, whatever their process group): killed, as
    a scheduler ends a job."""
    import psutil

    for process in psutil.process_iter(["pid"]):
        try:
            if process.pid != os.getpid() and os.getsid(process.pid) == child.pid:
                process.kill()
        except (psutil.Error, ProcessLookupError):
            continue


def _log(out: Path, resume: bool = False) -> str:
    return (out.parent / f"{out.name}{'.resume' if resume else ''}.log").read_text(errors="replace")


def _steps_done(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_for(condition, child: subprocess.Popen, timeout_s: float = RUN_TIMEOUT_S, poll_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if child.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the run ended or timed out (exit {child.poll()}) before the fault could be injected")
        time.sleep(poll_s)


def reference(scratch: Path) -> Path:
    """The uninterrupted run (made once per scratch folder)."""
    assets, out = _assets(scratch), scratch / "train_reference"
    if _steps_done(out) < STEPS:
        code = _finish(_start(assets, out))
        if code != 0:
            raise RuntimeError(f"the reference run failed (exit {code}): {_log(out)[-600:]}")
    return out


def _rollouts(out: Path) -> dict[int, list[dict]]:
    return {step: [json.loads(line) for line in (out / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]
            for step in range(STEPS) if (out / "rollouts" / f"step_{step}.jsonl").exists()}


def compare_runs(reference_out: Path, out: Path) -> tuple[list[str], int, int]:
    """(differences, samples lost, samples duplicated) of `out` against the reference run."""
    import torch
    from safetensors.torch import load_file

    ref, got = _rollouts(reference_out), _rollouts(out)
    ref_ids = [s["sample"] for step in sorted(ref) for s in ref[step]]
    got_ids = [s["sample"] for step in sorted(got) for s in got[step]]
    lost, duplicated = len(set(ref_ids) - set(got_ids)), len(got_ids) - len(set(got_ids))
    differences = []
    for step in sorted(ref):
        pairs = [(a["sample"], a["response_ids"]) for a in ref[step]], [(b["sample"], b["response_ids"])
                                                                         for b in got.get(step, [])]
        if pairs[0] != pairs[1]:
            differences.append(f"step {step}: samples or responses differ")
    rows = [[json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            for run in (reference_out, out)]
    if [row["step"] for row in rows[1]] != list(range(STEPS)):
        differences.append(f"metrics.jsonl steps {[row['step'] for row in rows[1]]}")
    for a, b in zip(*rows):
        for key in COMPARED:
            if not abs(a[key] - b[key]) <= 1e-4 * abs(a[key]) + 1e-6:
                differences.append(f"step {a['step']} {key}: {a[key]} vs {b[key]}")
    weights = [load_file(run / "hf" / f"step_{STEPS - 1}" / "model.safetensors") for run in (reference_out, out)]
    for name, tensor in weights[0].items():
        if not torch.allclose(weights[1][name], tensor, rtol=1e-5, atol=1e-6):
            differences.append(f"parameter {name} differs")
            break
    return differences, lost, duplicated


def _driver_killed(folder: Path) -> Observed:
    reference_out, assets, out = reference(folder.parent), _assets(folder.parent), folder / "run"
    child = _start(assets, out)
    _wait_for(lambda: (out / "checkpoints" / "step_1").is_dir(), child, poll_s=0.05)
    time.sleep(0.3)  # into step 3 (0-based 2): its data and rollout under way
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    _kill_session(child)
    killed_at = _steps_done(out)
    if killed_at != 2 or (out / "checkpoints" / "step_2").exists():
        return Observed(f"the kill came too late: {killed_at} steps logged", False)
    started = time.perf_counter()
    code = _finish(_start(assets, out, resume=True))
    recover = time.perf_counter() - started
    said = [line for line in _log(out, resume=True).splitlines() if line.startswith("--resume")]
    if code != 0:
        return Observed(f"--resume failed (exit {code}): {_log(out, resume=True)[-400:]}", False)
    differences, lost, duplicated = compare_runs(reference_out, out)
    seen = (f"killed with {killed_at} steps logged; {said[:1]}; the resumed run against the uninterrupted one: "
            + ("; ".join(differences) if differences else "the same sample ids, responses, metrics and parameters"))
    return Observed(seen, not differences and not lost and not duplicated, lost, duplicated, recover_s=recover)


def _policy_pids(child: subprocess.Popen, actor: str = "_Host") -> list[int]:
    """The run's processes of Ray actor class `actor` (`_Host`: the policy ranks, runtime/worker_group.py;
    `PreprocessActor`: the ShadowLoader's; `_RolloutActor`: separate rollout engines)."""
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        try:
            title = " ".join(process.info["cmdline"] or [])
            ours = os.getsid(process.pid) == child.pid or child.pid in [parent.pid for parent in process.parents()]
            if title.startswith(f"ray::{actor}") and ours:
                found.append(process.pid)
        except (psutil.Error, ProcessLookupError):
            continue
    return sorted(found)


def _restarted(folder: Path) -> Observed:
    reference_out, assets, out = reference(folder.parent), _assets(folder.parent), folder / "run"
    config = json.loads((assets / "run.json").read_text())
    config["flexrl"]["trainer"]["max_restarts"] = 1
    (folder / "restarts.json").write_text(json.dumps(config))
    child = _start(assets, out, config=folder / "restarts.json")
    _wait_for(lambda: _steps_done(out) >= 1 and (out / "checkpoints" / "step_0").is_dir(), child)
    os.kill(_policy_pids(child)[-1], signal.SIGKILL)
    injected = time.perf_counter()
    code = _finish(child)
    finished = time.perf_counter() - injected
    if code != 0:
        return Observed(f"the run failed (exit {code}): {_log(out)[-400:]}", False)
    restarts = [json.loads(line).get("num_restarts") for line in (out / "metrics.jsonl").read_text().splitlines()]
    differences, lost, duplicated = compare_runs(reference_out, out)
    said = [line for line in _log(out).splitlines() if "(flexrl.trainer.max_restarts)" in line]
    seen = (f"{said[:1]}; num_restarts per step {restarts}; against the uninterrupted run: "
            + ("; ".join(differences) if differences else "the same sample ids, responses, metrics and parameters"))
    passed = not differences and restarts[-1] == 1 and bool(said) and not lost and not duplicated
    return Observed(seen, passed, lost, duplicated, recover_s=finished)


def _rank_case(fault: str):
    def run(folder: Path) -> Observed:
        assets, out = _assets(folder.parent), folder / "run"
        child = _start(assets, out)
        _wait_for(lambda: _steps_done(out) >= 1 and (out / "checkpoints" / "step_0").is_dir(), child)
        victim = _policy_pids(child)[-1]
        injected = time.perf_counter()
        os.kill(victim, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        code = _finish(child)
        detect = time.perf_counter() - injected
        log = _log(out)
        named = re.search(rf"lost rank (\d+): rank \d+ \(pid {victim}\) (died|stalled)", log)
        survivors = [line for line in log.splitlines() if re.search(r"\(survivor\) (failed|stopped) at step", line)]
        rank = named.group(1) if named else "?"
        resumable = f"--resume, from {out / 'checkpoints'}" in log
        passed = (code != 0 and named is not None and len(survivors) == NUM_RANKS - 1 and resumable
                  and all(f"after losing rank {rank}" in line for line in survivors))
        seen = (f"exit {code} after {detect:.1f} s; " + (named.group(0) if named else "no line naming the lost rank")
                + f"; {len(survivors)} survivor line(s): {survivors[:1]}; resumable: {resumable}")
        recover = None
        if passed and fault == "kill":
            started = time.perf_counter()
            resumed = _finish(_start(assets, out, resume=True))
            recover = time.perf_counter() - started
            differences, lost, duplicated = compare_runs(reference(folder.parent), out)
            passed = resumed == 0 and not differences
            seen += f"; --resume: exit {resumed}, " + ("; ".join(differences) or "equal to the uninterrupted run")
            return Observed(seen, passed, lost, duplicated, detect, recover)
        return Observed(seen, bool(passed), detect_s=detect)
    return run


def _actor_killed(folder: Path) -> Observed:
    reference_out, assets, out = reference(folder.parent), _assets(folder.parent), folder / "run"
    child = _start(assets, out)
    _wait_for(lambda: _steps_done(out) >= 1, child)
    victims = _policy_pids(child, "PreprocessActor")
    if len(victims) < 2:
        _kill_session(child)
        return Observed(f"{len(victims)} preprocessing actor process(es) found; the case needs 2", False)
    os.kill(victims[-1], signal.SIGKILL)
    code = _finish(child)
    if code != 0:
        return Observed(f"the run failed (exit {code}): {_log(out)[-400:]}", False)
    differences, lost, duplicated = compare_runs(reference_out, out)
    seen = ("the run finished; against the uninterrupted run: "
            + ("; ".join(differences) if differences else "the same sample ids, responses, metrics and parameters"))
    return Observed(seen, not differences and not lost and not duplicated, lost, duplicated)


def _engine_killed(folder: Path) -> Observed:
    assets, out = _assets(folder.parent), folder / "run"
    separate = _separate_config(folder, assets)
    child = _start(assets, out, config=separate)
    _wait_for(lambda: _steps_done(out) >= 1 and (out / "checkpoints" / "step_0").is_dir(), child)
    victim = _policy_pids(child, "_RolloutActor")[-1]
    injected = time.perf_counter()
    os.kill(victim, signal.SIGKILL)
    code = _finish(child)
    detect = time.perf_counter() - injected
    line = next((line for line in _log(out).splitlines() if line.startswith("RuntimeError: ")
                 and "a worker died" in line and "At step" in line and "--resume, from" in line), None)
    started = time.perf_counter()
    resumed = _finish(_start(assets, out, resume=True, config=separate))
    recover = time.perf_counter() - started
    steps = [json.loads(row)["step"] for row in (out / "metrics.jsonl").read_text().splitlines()]
    passed = code != 0 and line is not None and resumed == 0 and steps == list(range(STEPS))
    return Observed(f"exit {code} after {detect:.1f} s: {line}; --resume: exit {resumed}, steps logged {steps}",
                    passed, lost=len(set(range(STEPS)) - set(steps)), duplicated=len(steps) - len(set(steps)),
                    detect_s=detect, recover_s=recover)


def _separate_config(folder: Path, assets: Path, max_restarts: int = 0) -> Path:
    """The run's config with one separate rollout engine (`colocate` false), written in `folder`."""
    config = json.loads((assets / "run.json").read_text())
    config["flexrl"]["trainer"].update(colocate=False, max_restarts=max_restarts)
    config["flexrl"]["rollout"].update(num_engines=1, num_cpus_per_engine=0.25)
    path = folder / f"separate_{max_restarts}.json"
    path.write_text(json.dumps(config))
    return path


def separate_reference(scratch: Path) -> Path:
    """The uninterrupted run with a separate engine (made once per scratch folder)."""
    assets, out = _assets(scratch), scratch / "train_reference_separate"
    if _steps_done(out) < STEPS:
        code = _finish(_start(assets, out, config=_separate_config(scratch, assets)))
        if code != 0:
            raise RuntimeError(f"the separate-engine reference run failed (exit {code}): {_log(out)[-600:]}")
    return out


def _engine_recreated(folder: Path) -> Observed:
    reference_out, assets, out = separate_reference(folder.parent), _assets(folder.parent), folder / "run"
    child = _start(assets, out, config=_separate_config(folder, assets, max_restarts=2))
    _wait_for(lambda: _policy_pids(child, "_RolloutActor"), child)
    first, saved = _policy_pids(child, "_RolloutActor")[-1], out / "checkpoints" / "step_0"
    _wait_for(lambda: saved.with_name("step_0.partial").is_dir() or saved.is_dir(), child, poll_s=0.02)
    os.kill(first, signal.SIGKILL)  # while step 1's checkpoint is written: found lost by step 2's rollout
    injected = time.perf_counter()
    _wait_for(lambda: _steps_done(out) >= 2 and set(_policy_pids(child, "_RolloutActor")) - {first}, child)
    os.kill(_policy_pids(child, "_RolloutActor")[-1], signal.SIGKILL)  # wherever step 3 is
    code = _finish(child)
    finished = time.perf_counter() - injected
    if code != 0:
        return Observed(f"the run failed (exit {code}): {_log(out)[-400:]}", False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    said = [line for line in _log(out).splitlines() if "every engine recreated in place" in line]
    differences, lost, duplicated = compare_runs(reference_out, out)
    seen = (f"{said}; num_engine_restarts per step {[row.get('num_engine_restarts') for row in rows]}, "
            f"num_restarts {[row.get('num_restarts') for row in rows]}; against the uninterrupted separate-engine "
            "run: " + ("; ".join(differences) if differences else "the same sample ids, responses, metrics and "
                                                                  "parameters"))
    passed = (not differences and len(said) == 2 and rows[-1].get("num_engine_restarts") == 2
              and rows[-1].get("num_restarts") == 0 and not lost and not duplicated)
    return Observed(seen, passed, lost, duplicated, recover_s=finished)


def _session_listeners(child: subprocess.Popen) -> set[tuple[str, str, int]]:
    """(process name, address, port) of every socket the run's processes listen on now."""
    import psutil

    names = {}
    for process in psutil.process_iter(["pid", "name"]):
        try:
            if os.getsid(process.pid) == child.pid:
                names[process.pid] = process.info["name"]
        except (psutil.Error, ProcessLookupError):
            continue
    return {(names[entry.pid], entry.laddr.ip, entry.laddr.port) for entry in psutil.net_connections("inet")
            if entry.status == psutil.CONN_LISTEN and entry.pid in names}


def _loopback(address: str) -> bool:
    return network.is_loopback(address.removeprefix("::ffff:"))  # an IPv4 address on an IPv6 socket


def _services_bind(folder: Path) -> Observed:
    """A separate-engine run (Ray, the ShadowLoader's actors, the policy ranks' and the weight channel's
    rendezvous and gloo groups), its listening sockets listed every second until it ends."""
    assets, out = _assets(folder.parent), folder / "run"
    child = _start(assets, out, config=_separate_config(folder, assets),
                   unset=(network.ENV_VAR, "MASTER_ADDR", "RAY_ADDRESS", network.RAY_SINGLE_MACHINE_VAR))
    seen: set[tuple[str, str, int]] = set()
    try:
        while child.poll() is None:
            seen |= _session_listeners(child)
            time.sleep(1.0)
    finally:
        code = _finish(child)
    exposed = sorted(f"{name} {ip}:{port}" for name, ip, port in seen if not _loopback(ip))
    processes = sorted({name for name, _, _ in seen})
    said = (f"exit {code}; {len(seen)} listening sockets of {len(processes)} kinds of process "
            f"({', '.join(processes[:8])}{' ...' if len(processes) > 8 else ''}); not on the loopback: "
            + (", ".join(exposed) if exposed else "none"))
    return Observed(said, code == 0 and bool(seen) and not exposed)


CASES = [
    Case("train:driver_killed", "the driver SIGKILLed during step 3 (its Ray processes after it), then --resume",
         "the resumed run's steps equal an uninterrupted run's (sample ids, responses, metrics, parameters); "
         "0 lost, 0 duplicated", _driver_killed, slow=True),
    Case("train:policy_rank_killed", "a policy rank's process SIGKILLed after step 1",
         "every survivor fails at once with a line naming the lost rank (its pid) and the step; --resume "
         "gives the uninterrupted run", _rank_case("kill"), slow=True),
    Case("train:policy_rank_stalled", f"a policy rank's process SIGSTOPped after step 1 (collective_timeout_s "
         f"{COLLECTIVE_TIMEOUT_S:g})", "every survivor fails within the collective timeout with a line naming the "
         "stalled rank (its pid) and the step; the last checkpoint complete", _rank_case("stop"), slow=True),
    Case("train:policy_rank_killed_restarted", "a policy rank SIGKILLed after step 1, flexrl.trainer.max_restarts 1",
         "the driver rebuilds its workers and goes on from the last checkpoint in the same job: it finishes equal "
         "to the uninterrupted run, num_restarts 1 in the metrics", _restarted, slow=True),
    Case("train:preprocessing_actor_killed", "one of 2 preprocessing actors SIGKILLed after step 1",
         "its work rerouted: the run finishes equal to the uninterrupted one, 0 lost, 0 duplicated", _actor_killed,
         slow=True),
    Case("train:rollout_engine_killed", "the separate rollout engine's process SIGKILLed after step 1 "
         "(flexrl.trainer.colocate false)", "the run ends with one line saying a worker died, the step and the "
         "checkpoint to resume from (max_restarts 0: not recreated); --resume runs to the end",
         _engine_killed, slow=True),
    Case("train:rollout_engine_killed_recreated", "the separate rollout engine's process SIGKILLed while step 1's "
         "checkpoint is written (found lost by step 2's rollout), its successor after step 2 (wherever the run is: "
         "often in a sync; the observed lines say where), flexrl.trainer.max_restarts 2",
         "each time the engine recreated in place from the policy's current weights and the call retried: "
         "the run finishes equal to an uninterrupted separate-engine run, "
         "num_engine_restarts 2, num_restarts 0", _engine_recreated, slow=True),
    Case("security:services_bind", "a `flexrl train` run with a separate rollout engine, its processes' listening "
         "sockets listed every second (no FLEXRL_NODE_IP_ADDRESS, MASTER_ADDR or RAY_ADDRESS)",
         "every socket on 127.0.0.1: Ray's GCS, raylet, workers and agents (Ray's single-machine mode, "
         "parallel/network.py), the rendezvous stores, the gloo groups", _services_bind, slow=True),
]
