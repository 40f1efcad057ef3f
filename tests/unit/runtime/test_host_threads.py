"""runtime/host_threads.py: how many host threads a policy rank computes with, and where from."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from flexrl_ds.config.flexrl_config import parse_run_config
from flexrl_ds.parallel.launch import read_launch_env
from flexrl_ds.runtime.host_threads import (HostThreads, apply_host_threads, automatic_host_threads,
                                            cgroup_cpu_quota, configured_host_threads, ranks_per_node, usable_cores)
from flexrl_ds.trainer.launch import policy_setup

CONFIG = Path(__file__).resolve().parents[3] / "ds_configs" / "grpo_tiny_cpu.json"


def test_only_the_run_config_sets_the_count_not_the_environment(monkeypatch):
    """Ray's job supervisor, torchrun and `ray exec` export OMP_NUM_THREADS=1 themselves: not a user's choice."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert configured_host_threads(6) == HostThreads(6, "flexrl.trainer.host_threads_per_rank")
    assert configured_host_threads(0) is None


@pytest.mark.parametrize("cores, ranks, loaders", [(16, 1, 0), (16, 2, 0), (16, 3, 0), (2, 4, 0), (1, 1, 0),
                                                   (64, 8, 0), (16, 1, 2), (16, 1, 2.5), (4, 1, 8), (128, 8, 4)])
def test_automatic_threads_share_the_nodes_cores_left_by_the_loaders_among_its_ranks(cores, ranks, loaders):
    choice = automatic_host_threads(cores, ranks, loaders)
    left = cores - loaders
    assert choice.threads >= 1
    assert choice.threads * ranks <= max(left, ranks)  # never more threads than free cores, one each at least
    assert (choice.threads + 1) * ranks > left  # and no core left idle that a rank could take
    assert f"{cores} cores" in choice.reason and f"{ranks} policy rank" in choice.reason


def test_ranks_per_node_counts_each_ranks_neighbours():
    assert ranks_per_node(["a", "b", "a", "a", "c"]) == [3, 1, 3, 3, 1]


@pytest.mark.parametrize("text, expected", [("400000 100000", 4), ("150000 100000", 1), ("50000 100000", 1),
                                            ("max 100000", None), ("", None), ("garbage", None)])
def test_a_cgroup_cpu_quota_caps_the_cores(tmp_path, text, expected):
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text(text + "\n")
    assert cgroup_cpu_quota(cpu_max) == expected
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(cpu_max) == (min(affinity, expected) if expected else affinity)
    assert cgroup_cpu_quota(tmp_path / "missing") is None


@pytest.mark.parametrize("name", ["LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"])
def test_a_launchers_local_size_reaches_the_launch_env(name):
    """torchrun exports LOCAL_WORLD_SIZE, DeepSpeed's launcher LOCAL_SIZE, Open MPI its own."""
    env = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", name: "2"}
    assert read_launch_env(env).local_world_size == 2
    assert read_launch_env({"RANK": "0", "WORLD_SIZE": "1"}).local_world_size == 1


def test_apply_sets_torch_and_openmp_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        apply_host_threads(HostThreads(2, "test"))
        assert torch.get_num_threads() == 2 and os.environ["OMP_NUM_THREADS"] == "2"
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("configured, expected", [(None, None), (0, None), (5, 5)])
def test_the_configured_count_reaches_every_policy_rank(monkeypatch, configured, expected):
    raw = json.loads(CONFIG.read_text())
    if configured is not None:
        raw["flexrl"]["trainer"]["host_threads_per_rank"] = configured
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # ignored
    setup = policy_setup(parse_run_config(raw), "model-dir", pixels=None, colocated=True)
    assert (setup.host_threads.threads if setup.host_threads else None) == expected
    pool = raw["flexrl"]["data"]["pool"]
    assert setup.loader_cpus_per_node == pool["num_actors_per_node"] * pool["num_cpus_per_actor"]


def test_the_run_config_refuses_a_negative_count():
    raw = json.loads(CONFIG.read_text())
    raw["flexrl"]["trainer"]["host_threads_per_rank"] = -4
    with pytest.raises(ValueError, match="host_threads_per_rank"):
        parse_run_config(raw)
