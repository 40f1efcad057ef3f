"""Joining Ray: the one place a driver (`flexrl train`, `flexrl logprobs`, `flexrl bench loader`)
starts or joins a cluster.

- `connect_ray(num_cpus)`: an already initialised session (tests) is reused; else the cluster of
  RAY_ADDRESS is joined (as under `ray job submit`, which sets it to the cluster's GCS address);
  else a new local one with `num_cpus` logical CPUs is started, also where `ray start` left a
  cluster running on this machine (Ray would join that one, and refuse `num_cpus`). Returns True
  when it started one (the caller stops it with `ray.shutdown()`). The one it starts has
  parallel/network.py's node address: 127.0.0.1 unless told otherwise, its servers listening there
  only (no dashboard either way).
- `ray_address()`: RAY_ADDRESS, checked to be one a driver can join (not a job server's URL) and,
  where it is host:port, to accept connections (Ray would wait for minutes).
- `join_ray(address, namespace)`: a second driver process joining a given cluster (a benchmark's
  per-run controller process, a launcher-started rank).
"""

from __future__ import annotations

import logging
import os
import socket

import ray

from flexrl_ds.parallel import network

logger = logging.getLogger(__package__)


def ray_address() -> str | None:
    """RAY_ADDRESS when set; ValueError where it is a job server's URL, which only `ray job submit`
    takes (a driver joins a cluster by its GCS address)."""
    address = os.environ.get("RAY_ADDRESS") or None
    if address and address.startswith(("http://", "https://")):
        raise ValueError(f"RAY_ADDRESS={address} is a Ray job server's URL, what `ray job submit` and "
                         "scripts/train_ray_job.sh take. A process that joins the cluster itself (flexrl "
                         "train --spmd under deepspeed or torchrun, or flexrl train run directly) needs the "
                         "cluster's GCS address, host:port (`ray start --head` prints it; port 6379 by "
                         "default), or no RAY_ADDRESS to start a local Ray")
    if address:
        check_reachable(address)
    return address


REACH_TIMEOUT_S = 5.0
"""How long `check_reachable` waits for a connection to RAY_ADDRESS (Ray itself retries for minutes)."""


def check_reachable(address: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """ValueError, within `timeout_s`, where nothing accepts connections at a host:port RAY_ADDRESS.
    Other forms ("auto", "local", "ray://...") are left to Ray."""
    host, _, port = address.rpartition(":")
    if not host or "://" in address or not port.isdigit() or (":" in host and not host.startswith("[")):
        return  # not host:port (an unbracketed IPv6 address included: Ray names its format)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as error:
        if isinstance(error, socket.gaierror):
            reason = f"cannot resolve the host {host!r}"
        elif isinstance(error, TimeoutError):
            reason = f"no answer within {timeout_s:.0f} s"
        else:
            reason = error.strerror or str(error)
        raise ValueError(f"RAY_ADDRESS={address}: no Ray cluster reachable there ({reason}). Start one with "
                         "`ray start --head`, correct the address, or unset RAY_ADDRESS to start a local Ray") from None


def connect_ray(num_cpus: int) -> bool:
    """Join RAY_ADDRESS, reuse an initialised session, or start a local cluster; True if started here."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    address = ray_address()
    if address:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        return False
    node_ip = network.node_ip_address()
    check_loopback_mode(node_ip)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False,
             configure_logging=False, **({} if node_ip is None else {"_node_ip_address": node_ip}))
    return True


def check_loopback_mode(node_ip: str | None) -> None:
    """A warning where a Ray to be started on the loopback would listen on every interface: Ray was
    imported before flexrl_ds could choose its single-machine mode (parallel/network.py)."""
    if node_ip is None or not network.is_loopback(node_ip):
        return
    if not network.is_loopback(ray.util.get_node_ip_address()):
        logger.warning(f"Ray was imported before flexrl_ds, without {network.RAY_SINGLE_MACHINE_VAR}=0: the local "
                       f"Ray's servers listen on every interface, not on {node_ip} only. Import flexrl_ds first, "
                       f"or set {network.RAY_SINGLE_MACHINE_VAR}=0 before Python starts")


def join_ray(address: str, namespace: str | None = None) -> None:
    """Join the cluster at GCS `address` as a driver (in `namespace`, where named actors are found)."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=address, namespace=namespace, log_to_driver=False, configure_logging=False)


def gcs_address() -> str:
    """GCS address of the cluster this process is connected to (for `join_ray` elsewhere)."""
    return ray.get_runtime_context().gcs_address


def num_alive_nodes() -> int:
    """Alive nodes of the connected cluster."""
    return sum(1 for node in ray.nodes() if node.get("Alive"))
