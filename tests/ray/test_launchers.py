"""Both launchers run the tiny config end to end: `ray job submit` (scripts/train_ray_job.sh, local
head on 127.0.0.1) and `deepspeed --hostfile` (scripts/train_deepspeed.sh, SPMD, rank 0 drives).
The Ray job runs its rollout engine as a separate Ray actor (`colocate: false`, weights sent over
policy rank 0's weight channel), the SPMD run inside the ranks. They share the model, data and seed, so
step 0 must sample the same responses; after the Ray job's first sync its engine must generate
with the updated weights (`rollout_logprob_diff` ~ fp32 noise at step 1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from flexrl_ds.bench.datasets import make_dataset
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("launch")
    make_tiny_model(TinyModelConfig(out_dir=str(root / "model")))
    make_dataset(root / "data", "image-heavy", 6, "small", seed=1, task="keyword")
    (root / "hostfile").write_text("localhost slots=4\n")
    return root


UNREAD_NOTE = "DeepSpeed config: DeepSpeed did not read 'gradient_clippping'"
"""What policy rank 0 says of the key `config_file` misspells (models/zero3.unread_keys_note)."""
THREADS_NOTE = "host threads per policy rank: 1 (flexrl.trainer.host_threads_per_rank)"
"""What the ranks say when `config_file` sets the key: it reaches them under both launchers."""


def config_file(path: Path, **trainer) -> Path:
    """The tiny config with `trainer` on top and one key DeepSpeed never reads, which rank 0 names
    on the launcher's console (a Ray actor's output reaches it only as a said line: common/notes.py)."""
    config = json.loads((ROOT / "ds_configs" / "grpo_tiny_cpu.json").read_text())
    config["flexrl"]["trainer"].update(trainer)
    config["gradient_clippping"] = 1.0
    path.write_text(json.dumps(config))
    return path


def launch(script: str, assets: Path, out: Path, *first: str, config: Path | None = None,
           steps: int = 1) -> subprocess.CompletedProcess:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1",
           "FLEXRL_RAY_DASHBOARD_PORT": "8297", "MASTER_PORT": "29533"}
    env.pop("RAY_ADDRESS", None)
    config = config or ROOT / "ds_configs" / "grpo_tiny_cpu.json"
    command = ["bash", str(ROOT / "scripts" / script), *first, str(config),
               "--model", str(assets / "model"), "--data", str(assets / "data" / "train.jsonl"),
               "--out", str(out), "--max-steps", str(steps)]
    return run_as_group(command, env, timeout=900)


def run_as_group(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """Run a launcher in a process group of its own and stop the whole group however the test ends
    (a timeout, pytest-timeout's alarm, ^C): SIGTERM first, which the launcher traps to stop its Ray
    head, then SIGKILL. A plain subprocess.run kills only bash and leaves the head holding its ports.
    A timeout fails the test with the launcher's output."""
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(process)
        stdout, stderr = process.communicate(timeout=60)
        pytest.fail(f"{command[1]} ran past {timeout} s; its output:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    finally:
        stop_group(process)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def stop_group(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to every process of the launcher's group, SIGKILL to what is left after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return  # nothing of the group is left
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            process.poll()  # reaps the leader (bash) once it exits
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def check_run(result: subprocess.CompletedProcess, out: Path, steps: int = 1) -> tuple[list[dict], list[dict]]:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"step {steps}/{steps}" in result.stdout + result.stderr
    assert (result.stdout + result.stderr).count(UNREAD_NOTE) == 1  # said by rank 0 once, not by the reference
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(steps))
    assert (out / "checkpoints" / f"step_{steps - 1}" / "trainer_state.json").exists()
    assert (out / "hf" / f"step_{steps - 1}" / "config.json").exists()
    return rows, [json.loads(line) for line in (out / "rollouts" / "step_0.jsonl").read_text().splitlines()]


def test_both_launchers_train_the_same_step(assets, tmp_path):
    separate = config_file(tmp_path / "separate.json", colocate=False, host_threads_per_rank=1)
    result = launch("train_ray_job.sh", assets, tmp_path / "ray_job", config=separate, steps=2)
    rows, ray_job = check_run(result, tmp_path / "ray_job", steps=2)
    assert THREADS_NOTE in result.stdout + result.stderr
    assert rows[1]["rollout_logprob_diff"] < 1e-4, rows[1]["rollout_logprob_diff"]
    assert all(set(row["rollout_time_s"]) == {"pixels", "generate"} for row in rows)  # separate engines never sleep
    spmd_config = config_file(tmp_path / "spmd.json", host_threads_per_rank=1)
    result = launch("train_deepspeed.sh", assets, tmp_path / "spmd", str(assets / "hostfile"), config=spmd_config)
    _, spmd = check_run(result, tmp_path / "spmd")
    assert THREADS_NOTE in result.stdout + result.stderr
    assert [s["sample"] for s in ray_job] == [s["sample"] for s in spmd]
    assert [s["response_ids"] for s in ray_job] == [s["response_ids"] for s in spmd]
    assert [s["reward"] for s in ray_job] == pytest.approx([s["reward"] for s in spmd])


def test_ray_job_launcher_returns_the_job_status(assets, tmp_path, ray_session):
    """A job that fails (here: no such model directory) makes the launcher exit non-zero. Another Ray
    runs on the machine meanwhile (the tests' session): the launcher's head takes ports of its own
    (with Ray's fixed dashboard-agent port its agent could not bind and the head went down)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    for name in ("RAY_ADDRESS", "FLEXRL_RAY_DASHBOARD_PORT"):
        env.pop(name, None)
    result = run_as_group(
        ["bash", str(ROOT / "scripts" / "train_ray_job.sh"), str(ROOT / "ds_configs" / "grpo_tiny_cpu.json"),
         "--model", str(tmp_path / "missing"), "--data", str(assets / "data" / "train.jsonl"),
         "--out", str(tmp_path / "out")], env, timeout=600)
    assert result.returncode != 0
    assert "missing" in result.stdout + result.stderr
