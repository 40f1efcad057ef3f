"""Joining Ray: the one place a driver (`flexrl train`, `flexrl logprobs`, `flexrl bench loader`)
starts or joins a cluster.

- `connect_ray(num_cpus)`: an already initialised session (tests) is reused; else the cluster of
  RAY_ADDRESS is joined (as under `ray job submit`); else a local one with `num_cpus` logical CPUs
  is started. Returns True when it started one (the caller stops it with `ray.shutdown()`).
- `join_ray(address, namespace)`: a second driver process joining a given cluster (a benchmark's
  per-run controller process, a launcher-started rank).
"""

from __future__ import annotations

import os

import ray


def connect_ray(num_cpus: int) -> bool:
    """Join RAY_ADDRESS, reuse an initialised session, or start a local cluster; True if started here."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, configure_logging=False)
        return False
    ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    return True


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
