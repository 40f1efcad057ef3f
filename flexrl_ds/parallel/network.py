"""Where the services a run starts listen: 127.0.0.1 unless told otherwise.

A run on one machine needs no port reachable from other machines, so every service the tools start
binds to the loopback address by default: the local Ray that `flexrl train` / `flexrl logprobs` /
`flexrl bench loader` start (its GCS, raylet, object manager, workers' and agents' servers), the
rendezvous stores of the worker groups and of the weight channel (`listening_socket`), and the
collectives' own sockets (gloo's, NCCL's bootstrap: parallel/device.py
`pin_collectives`).

Told otherwise by, as users of Ray and torch expect:
- `FLEXRL_NODE_IP_ADDRESS` (`flexrl --node-ip-address ADDR`, Ray's `ray start --node-ip-address`):
  the address this node's services announce (and bind to, where they can bind one address);
- `MASTER_ADDR` naming another host (a launcher's multi-node job): the ranks reach each other there,
  so nothing is pinned to the loopback;
- `RAY_ADDRESS`: a cluster started by the user (`ray start`), bound as its `ray start` said.

Ray 2.60 binds its core servers to the loopback only where the node's IP is exactly 127.0.0.1, and
resolves a node IP of 127.0.0.1 given to `ray.init` / `ray start` to the machine's routable address
unless Ray runs in its single-machine mode (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, read when Ray is
imported, Ray's default on macOS and Windows). `prepare_ray_environment` sets that variable where the
node binds to the loopback; flexrl_ds/__init__.py calls it, so that it precedes every import of Ray
by flexrl_ds. For any other node address Ray's core servers listen on every interface (Ray has no
option to bind them to one address).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Mapping, MutableMapping

ENV_VAR = "FLEXRL_NODE_IP_ADDRESS"
"""The address this node's services announce and bind to (`flexrl --node-ip-address`)."""
LOOPBACK = "127.0.0.1"
RAY_SINGLE_MACHINE_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch for its single-machine mode ("0": the node's IP is 127.0.0.1, Ray's servers bind there)."""


def is_loopback(host: str) -> bool:
    """True for localhost and any loopback IP (127.0.0.0/8, ::1)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def node_ip_address(env: Mapping[str, str] | None = None) -> str | None:
    """The address this node's services bind to and announce: FLEXRL_NODE_IP_ADDRESS; else None
    (Ray's and torch's own choice: every interface) where MASTER_ADDR names another host (a
    multi-node launcher job); else 127.0.0.1."""
    env = os.environ if env is None else env
    told = env.get(ENV_VAR, "").strip()
    if told:
        return told
    master = env.get("MASTER_ADDR", "").strip()
    if master and not is_loopback(master):
        return None
    return LOOPBACK


def binds_to_loopback(env: Mapping[str, str] | None = None) -> bool:
    """True where this node's services are to listen on the loopback only."""
    address = node_ip_address(env)
    return address is not None and is_loopback(address)


def prepare_ray_environment(env: MutableMapping[str, str] | None = None) -> None:
    """Ray's single-machine mode where a Ray this process starts is to bind to the loopback (no
    RAY_ADDRESS: no cluster of the user's to join). Must run before Ray is imported; a value the
    user set is kept."""
    env = os.environ if env is None else env
    if binds_to_loopback(env) and not env.get("RAY_ADDRESS"):
        env.setdefault(RAY_SINGLE_MACHINE_VAR, "0")


def listening_socket(host: str, port: int = 0) -> socket.socket:
    """A TCP socket bound to `host`:`port` (0: one the OS picks) and listening: a rendezvous store's
    (torch's TCPStore takes its descriptor as `master_listen_fd`; it binds every interface itself)."""
    family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(1024)
    return listener


def loopback_interface() -> str:
    """The name of the network interface holding 127.0.0.1 ("lo" on Linux, "lo0" on macOS)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(entry.family == socket.AF_INET and entry.address == LOOPBACK for entry in addresses):
            return name
    return "lo"
