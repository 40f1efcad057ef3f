"""Where the services a run starts listen (parallel/network.py): the loopback unless told otherwise.

The listening addresses are read back from the operating system (psutil's socket table), not from
the code that chose them."""

from __future__ import annotations

import datetime
import os
import socket

import psutil
import pytest
import torch.distributed as dist

from flexrl_ds.parallel import device, network
from flexrl_ds.parallel.launch import LaunchEnv, launcher_hosts_store, rendezvous_store
from flexrl_ds.runtime.worker_group import open_store


def _listening_addresses(port: int) -> set[str]:
    return {entry.laddr.ip for entry in psutil.net_connections("inet")
            if entry.status == psutil.CONN_LISTEN and entry.pid == os.getpid() and entry.laddr.port == port}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("host, expected", [("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True),
                                            ("::1", True), ("[::1]", True), ("10.0.0.5", False),
                                            ("0.0.0.0", False), ("head-node", False)])
def test_is_loopback(host, expected):
    assert network.is_loopback(host) is expected


@pytest.mark.parametrize("env, expected", [
    ({}, "127.0.0.1"),
    ({"MASTER_ADDR": "127.0.0.1"}, "127.0.0.1"),
    ({"MASTER_ADDR": "10.0.0.5"}, None),  # a multi-node launcher job: Ray's and torch's own choice
    ({"MASTER_ADDR": "10.0.0.5", network.ENV_VAR: "10.0.0.7"}, "10.0.0.7"),
    ({network.ENV_VAR: "192.168.1.2"}, "192.168.1.2"),
])
def test_node_ip_address(env, expected):
    assert network.node_ip_address(env) == expected


def test_ray_single_machine_mode_only_where_flexrl_starts_a_loopback_ray():
    env: dict[str, str] = {}
    network.prepare_ray_environment(env)
    assert env == {network.RAY_SINGLE_MACHINE_VAR: "0"}
    for told in ({"RAY_ADDRESS": "10.0.0.5:6379"}, {network.ENV_VAR: "10.0.0.7"}, {"MASTER_ADDR": "10.0.0.5"}):
        env = dict(told)
        network.prepare_ray_environment(env)
        assert env == told
    env = {network.RAY_SINGLE_MACHINE_VAR: "1"}  # the user's choice is kept
    network.prepare_ray_environment(env)
    assert env == {network.RAY_SINGLE_MACHINE_VAR: "1"}


def test_a_worker_groups_store_listens_on_its_host_only():
    store = open_store("127.0.0.1", 2, 30.0)
    assert _listening_addresses(store.port) == {"127.0.0.1"}
    client = dist.TCPStore("127.0.0.1", store.port, 2, is_master=False, timeout=datetime.timedelta(seconds=30))
    client.set("key", "value")
    assert store.get("key") == b"value"


def test_the_launchers_rendezvous_listens_on_a_loopback_master_addr_only():
    launch = LaunchEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=_free_port())
    store = rendezvous_store(launch, datetime.timedelta(seconds=30))
    assert _listening_addresses(launch.master_port) == {"127.0.0.1"}
    store.set("key", "value")
    assert store.get("key") == b"value"


def test_collectives_pinned_to_the_loopback_interface(monkeypatch):
    for name in device.INTERFACE_VARS:
        monkeypatch.setenv(name, "recorded")  # so that the test's own settings are undone after it
        monkeypatch.delenv(name)
    device.pin_collectives("10.0.0.5")
    assert not any(name in os.environ for name in device.INTERFACE_VARS)
    device.pin_collectives("127.0.0.1")
    loopback = {name for name, addresses in psutil.net_if_addrs().items()
                if any(entry.address == "127.0.0.1" for entry in addresses)}
    assert all(os.environ[name] in loopback for name in device.INTERFACE_VARS)
    monkeypatch.setenv(device.INTERFACE_VARS[0], "eth7")  # the user's choice is kept
    device.pin_collectives("127.0.0.1")
    assert os.environ[device.INTERFACE_VARS[0]] == "eth7"


def test_a_launcher_hosted_store_is_joined_not_hosted():
    hosted = open_store("127.0.0.1", 1, 30.0)  # as torchrun's agent holds it (TORCHELASTIC_USE_AGENT_STORE)
    launch = LaunchEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=hosted.port)
    assert launcher_hosts_store({"TORCHELASTIC_USE_AGENT_STORE": "True"}) and not launcher_hosts_store({})
    client = rendezvous_store(launch, datetime.timedelta(seconds=30), launcher_hosted=True)
    client.set("key", "value")
    assert hosted.get("key") == b"value"
