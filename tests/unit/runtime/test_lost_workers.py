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
from flexrl_ds.runtime.lost_workers import lost_worker_error, raise_lost_worker  # noqa: E402
from flexrl_ds.trainer.launch import policy_memory_hint  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[3] / "ds_configs"
# lines of what Ray 2.60 printed when its memory monitor killed a 7B policy rank on the H200
# (docs/notes/one-h200-runs-2026-12-04.md, "One H200, twenty-first run"; the process table between
# them left out)
MEMORY_KILL = ("Ray killed 1 worker(s) based on the killing policy\nConsidered workers: [\n]\n"
               "Refer to the documentation on how to address the out of memory issue: "
               "https://docs.ray.io/en/latest/ray-observability/user-guides/debug-apps/debug-memory.html. "
               "Consider provisioning more memory on this node or reducing task parallelism by requesting "
               "more CPUs per task.")


def died(message: str) -> Exception:
    return ray.exceptions.ActorDiedError(ActorDiedErrorContext(error_message=message, class_name="_Host",
                                                               actor_id=b"\x01" * 16, node_ip_address="10.0.0.3"))


@pytest.mark.parametrize("error", [died(MEMORY_KILL), ray.exceptions.OutOfMemoryError(MEMORY_KILL)],
                         ids=["actor-died", "out-of-memory"])
def test_a_memory_monitor_kill_names_host_memory_and_the_hint(error):
    said = str(lost_worker_error(error, "policy.generate", "A policy rank's host memory holds X"))
    assert said.startswith("policy.generate: Ray's memory monitor killed a worker because its node ran low on host memory")
    assert "A policy rank's host memory holds X" in said and len(said.splitlines()) == 1


# what Ray 2.60 says of an actor whose process exited (os._exit) on this machine
EXITED = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
          "detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes "
          "include: (1) the process was killed by the OOM killer due to high memory usage, (2) ray stop --force "
          "was called, or (3) the worker crashed unexpectedly due to SIGSEGV or another unexpected error.")


def test_a_worker_that_exited_is_said_without_rays_list_of_possible_causes():
    """The list of causes Ray gives for every death (the OOM killer among them) is no memory kill,
    and stays in the attached report rather than the one line."""
    said = str(lost_worker_error(died(EXITED), "policy.die"))
    assert said.startswith("policy.die: a worker died (The actor is dead because its worker process has died. "
                           "Worker exit type: SYSTEM_ERROR")
    assert "connection error code 2. End of file. on 10.0.0.3)" in said
    assert "memory" not in said and "Some common causes" not in said


def test_a_long_account_is_cut():
    said = str(lost_worker_error(died("x" * 1000), "policy.die"))
    assert ("x" * 237 + "... on 10.0.0.3)") in said and "x" * 238 not in said


def test_another_death_says_a_worker_died_why_and_where_its_log_is():
    message = "The actor's worker process exited: SIGSEGV"
    said = str(lost_worker_error(died(message), "policy.train_step"))
    assert said.startswith(f"policy.train_step: a worker died ({message} on 10.0.0.3)")
    assert "memory" not in said and "/tmp/ray/session_latest/logs" in said
    bare = str(lost_worker_error(ray.exceptions.ActorDiedError(), "policy.train_step"))  # Ray knew no more
    assert bare.startswith("policy.train_step: a worker died (The actor died unexpectedly before finishing this task.)")


def test_the_workers_own_exception_is_not_a_lost_worker():
    raised_by_worker = ray.exceptions.RayTaskError("call", "Traceback ...", ValueError("bad sample 'a'"))
    assert lost_worker_error(raised_by_worker, "policy.generate") is None
    assert lost_worker_error(ValueError("low on memory"), "policy.generate") is None
    with pytest.raises(ValueError, match="bad sample"):  # raised as it came
        raise_lost_worker(ValueError("bad sample 'a'"), "policy.generate")
    with pytest.raises(RuntimeError, match="memory monitor") as raised:
        raise_lost_worker(died(MEMORY_KILL), "policy.generate")
    assert isinstance(raised.value.__cause__, ray.exceptions.ActorDiedError)


def run_config(name: str, trainer: dict | None = None, vllm: dict | None = None, zero: dict | None = None):
    raw = json.loads((CONFIGS / name).read_text())
    raw["zero_optimization"].update(zero or {})
    raw["flexrl"]["trainer"].update(trainer or {})
    raw["flexrl"]["rollout"].setdefault("vllm", {}).update(vllm or {})
    return parse_run_config(raw)


PARTS = {"optimizer": "zero_optimization.offload_optimizer", "reference": "flexrl.trainer.reference_offload_param",
         "states": "flexrl.trainer.offload_states_in_rollout", "engine": "flexrl.rollout.vllm.sleep_level 1",
         "parameters": "zero_optimization.offload_param"}


@pytest.mark.parametrize("trainer, vllm, named", [
    ({}, {}, {"optimizer"}),  # the 7B file: only its optimizer offload
    ({"reference_offload_param": True}, {}, {"optimizer", "reference"}),
    ({"offload_states_in_rollout": True}, {}, {"optimizer", "states"}),
    ({}, {"sleep_level": 1}, {"optimizer", "engine"}),
    ({"colocate": False, "offload_states_in_rollout": True}, {"sleep_level": 1}, {"optimizer"}),  # no engine inside
])
def test_the_policy_hint_names_each_setting_that_puts_the_rank_in_host_memory(trainer, vllm, named):
    seven_b = json.loads((CONFIGS / "grpo_vl7b_1xh200.json").read_text())["zero_optimization"]["offload_optimizer"]
    hint = policy_memory_hint(run_config("grpo_vl7b_1xh200.json", trainer, vllm))
    assert {part for part, key in PARTS.items() if key in hint} == named, hint
    assert f"ratio {seven_b['ratio']}, pin_memory {str(seven_b['pin_memory']).lower()}" in hint


def test_offloaded_parameters_are_named():
    run = run_config("grpo_vl3b_1xh200.json", zero={"offload_param": {"device": "cpu", "pin_memory": True}})
    assert "zero_optimization.offload_param" in policy_memory_hint(run)


def test_nothing_in_host_memory_is_said_as_such():
    run = run_config("grpo_vl3b_1xh200.json", vllm={"sleep_level": 2})  # its optimizer stays on the GPU
    hint = policy_memory_hint(run)
    assert hint.startswith("None of the run's settings"), hint
    assert "holds" not in hint and "flexrl.rollout.vllm.sleep_level 1" in hint, hint
    separate = run_config("grpo_vl3b_1xh200.json", {"colocate": False, "offload_states_in_rollout": True},
                          {"sleep_level": 1})  # both settings act only on an engine inside the rank
    named = policy_memory_hint(separate)
    assert named.startswith("None of") and "offload_states_in_rollout" not in named and "sleep_level" not in named


def test_a_memory_kill_says_that_no_setting_keeps_states_in_host_memory():
    run = run_config("grpo_vl3b_1xh200.json", vllm={"sleep_level": 2})
    said = str(lost_worker_error(died(MEMORY_KILL), "policy.train_step", policy_memory_hint(run)))
    assert said.startswith("policy.train_step: Ray's memory monitor killed a worker")
    assert f"RAY_memory_usage_threshold). {policy_memory_hint(run)}. Ray's report is above." in said
