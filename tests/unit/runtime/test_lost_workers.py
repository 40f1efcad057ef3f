"""A worker Ray lost, said in one line: a memory-monitor kill names host memory and what of the run
lives there; another death says so; the worker's own exceptions pass unchanged. Ray's own error
objects (no cluster needed) stand in for what `ray.get` raises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
from ray.core.generated.common_pb2 import ActorDiedErrorContext  # noqa: E402

from flexrl_ds.config.flexrl_config import parse_run_config  # noqa: E402
from flexrl_ds.runtime.lost_workers import lost_worker_error  # noqa: E402
from flexrl_ds.trainer.launch import policy_memory_hint  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[3] / "ds_configs"
# lines of what Ray 2.60 printed when its memory monitor killed a 7B policy rank on the H200
# (docs/BENCHMARKS.md "twenty-first run"; the process table between them left out)
MEMORY_KILL = ("Ray killed 1 worker(s) based on the killing policy\nConsidered workers: [\n]\n"
               "Refer to the documentation on how to address the out of memory issue: "
               "https://docs.ray.io/en/latest/ray-observability/user-guides/debug-apps/debug-memory.html. "
               "Consider provisioning more memory on this node or reducing task parallelism by requesting "
               "more CPUs per task.")


def died(message: str) -> Exception:
    return ray.exceptions.ActorDiedError(ActorDiedErrorContext(error_message=message, class_name="_Host",
                                                               actor_id=b"\x01" * 16))


@pytest.mark.parametrize("error", [died(MEMORY_KILL), ray.exceptions.OutOfMemoryError(MEMORY_KILL)],
                         ids=["actor-died", "out-of-memory"])
def test_a_memory_monitor_kill_names_host_memory_and_the_hint(error):
    said = str(lost_worker_error(error, "policy.generate", "A policy rank's host memory holds X"))
    assert said.startswith("policy.generate: Ray's memory monitor killed a worker because its node ran low on host memory")
    assert "A policy rank's host memory holds X" in said and len(said.splitlines()) == 1


def test_another_death_says_a_worker_died_and_where_its_log_is():
    said = str(lost_worker_error(died("The actor's worker process exited: SIGSEGV"), "policy.train_step"))
    assert said.startswith("policy.train_step: a worker died (The actor died unexpectedly before finishing this task.)")
    assert "memory" not in said and "/tmp/ray/session_latest/logs" in said


def test_the_workers_own_exception_is_not_a_lost_worker():
    raised_by_worker = ray.exceptions.RayTaskError("call", "Traceback ...", ValueError("bad sample 'a'"))
    assert lost_worker_error(raised_by_worker, "policy.generate") is None
    assert lost_worker_error(ValueError("low on memory"), "policy.generate") is None


def run_config(name: str, **trainer):
    raw = json.loads((CONFIGS / name).read_text())
    raw["flexrl"]["trainer"].update(trainer)
    return parse_run_config(raw)


def test_the_policy_hint_names_the_settings_that_use_host_memory():
    seven_b = json.loads((CONFIGS / "grpo_vl7b_1xh200.json").read_text())["zero_optimization"]["offload_optimizer"]
    hint = policy_memory_hint(run_config("grpo_vl7b_1xh200.json"))
    assert f"ratio {seven_b['ratio']}, pin_memory {str(seven_b['pin_memory']).lower()}" in hint
    assert "reference_offload_param" not in hint
    assert "reference_offload_param" in policy_memory_hint(run_config("grpo_vl7b_1xh200.json",
                                                                      reference_offload_param=True))
    assert policy_memory_hint(run_config("grpo_vl3b_1xh200.json")) == ""  # nothing of it in host memory
