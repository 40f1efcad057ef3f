"""Start torch.distributed from the launcher's environment (torchrun, `deepspeed`, mpirun, or by hand).

torchrun and DeepSpeed's launcher both export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT; mpirun exports OMPI_COMM_WORLD_*. `read_launch_env` reads them (validated, with a
message naming the variable), `init_distributed` creates the default process group on the backend
`flexrl_ds.parallel.device` chooses and wraps it for `deepspeed.comm` when DeepSpeed is installed.
`one_rank_env` sets the variables for a one-process group where no launcher did (the benches).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Mapping

from flexrl_ds.parallel import device as device_mod
from flexrl_ds.parallel import network


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as the launcher described it."""

    rank: int
    """Global rank (RANK / OMPI_COMM_WORLD_RANK)."""
    world_size: int
    """Processes in the job (WORLD_SIZE / OMPI_COMM_WORLD_SIZE)."""
    local_rank: int
    """Rank on this host, selects the GPU (LOCAL_RANK / OMPI_COMM_WORLD_LOCAL_RANK)."""
    master_addr: str
    """Rendezvous host (MASTER_ADDR, default 127.0.0.1)."""
    master_port: int
    """Rendezvous port (MASTER_PORT, default 29500)."""
    local_world_size: int = 1
    """Processes on this host (LOCAL_WORLD_SIZE / LOCAL_SIZE / OMPI_COMM_WORLD_LOCAL_SIZE, default 1)."""

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"launch env: rank {self.rank} is not inside world size {self.world_size}")
        if self.local_rank < 0:
            raise ValueError(f"launch env: LOCAL_RANK must be >= 0, got {self.local_rank}")


def _int_var(env: Mapping[str, str], names: tuple[str, ...], default: int | None) -> int:
    for name in names:
        if name in env:
            try:
                return int(env[name])
            except ValueError:
                raise ValueError(f"launch env: {name}={env[name]!r} is not an integer") from None
    if default is None:
        raise ValueError(f"launch env: none of {', '.join(names)} is set (start with torchrun or deepspeed)")
    return default


def read_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """The launcher's variables; a single process without any of them is rank 0 of 1."""
    env = os.environ if env is None else env
    rank = _int_var(env, ("RANK", "OMPI_COMM_WORLD_RANK"), 0)
    return LaunchEnv(
        rank=rank,
        world_size=_int_var(env, ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"), 1),
        local_rank=_int_var(env, ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"), rank),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int_var(env, ("MASTER_PORT",), 29500),
        local_world_size=_int_var(env, ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"), 1),
    )


@dataclass(frozen=True)
class DistContext:
    """An initialized process: its launch position, device and backend."""

    launch: LaunchEnv
    info: device_mod.DeviceInfo
    device: object
    """torch.device this process computes on."""
    deepspeed_comm: bool
    """True if deepspeed.comm wraps the default group (DeepSpeed's sequence primitives usable)."""


def init_distributed(env: Mapping[str, str] | None = None, force_cpu: bool | None = None,
                     timeout_s: float = 300.0, with_deepspeed: bool = True,
                     rendezvous_timeout_s: float | None = None) -> DistContext:
    """Create the default process group from the launch env (idempotent).

    timeout_s: the group's collective timeout. rendezvous_timeout_s: how long the ranks wait for each
    other to join at start (None: `timeout_s`); apart from the collective timeout, since the ranks of a
    launcher start as far apart as their imports on a busy node, while a lost rank should be named soon.
    with_deepspeed: also wrap it in deepspeed.comm (imports DeepSpeed, a few seconds) when installed.
    """
    import torch.distributed as dist


    launch = read_launch_env(env)
    info = device_mod.detect(force_cpu)
    device_mod.configure_deepspeed_accelerator(info)
    device = device_mod.set_local_device(info, launch.local_rank)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        joining = datetime.timedelta(seconds=timeout_s if rendezvous_timeout_s is None else rendezvous_timeout_s)
        device_mod.pin_collectives(launch.master_addr)
        dist.init_process_group(backend=info.backend, rank=launch.rank, world_size=launch.world_size,
                                store=rendezvous_store(launch, joining, launcher_hosts_store(env)), timeout=timeout)
    return DistContext(launch=launch, info=info, device=device,
                       deepspeed_comm=with_deepspeed and ensure_deepspeed_comm(info.backend))


def launcher_hosts_store(env: Mapping[str, str] | None = None) -> bool:
    """Whether the launcher hosts the rendezvous store itself (torchrun's agent, a test pool:
    TORCHELASTIC_USE_AGENT_STORE=True, as torch reads it); then every rank is its client."""
    return (os.environ if env is None else env).get("TORCHELASTIC_USE_AGENT_STORE") == str(True)


def rendezvous_store(launch: LaunchEnv, timeout: datetime.timedelta, launcher_hosted: bool = False):
    """The job's rendezvous store at MASTER_ADDR:MASTER_PORT, hosted by rank 0 unless the launcher
    hosts it (`launcher_hosted`). On a loopback MASTER_ADDR (one machine) rank 0's listens there only
    (torch's own listens on every interface: parallel/network.py); on another host's address, as
    torch's `tcp://` rendezvous does."""
    import torch.distributed as dist

    hosts = launch.rank == 0 and not launcher_hosted
    listen_fd = None
    if hosts and network.is_loopback(launch.master_addr):
        listen_fd = network.listening_socket(launch.master_addr, launch.master_port).detach()
    return dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=hosts,
                         timeout=timeout, master_listen_fd=listen_fd)


def ensure_deepspeed_comm(backend: str) -> bool:
    """Wrap an initialized torch.distributed in deepspeed.comm (no collective); False if unavailable."""
    try:
        import deepspeed.comm as ds_comm
    except Exception:
        return False
    if not ds_comm.is_initialized():
        ds_comm.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)
    return bool(ds_comm.is_initialized())


def one_rank_env(command: str) -> dict[str, str]:
    """A one-process group's launch variables, set where a launcher has not (DeepSpeed reads them);
    `command` (e.g. "flexrl bench update") names what refuses a launcher's bigger world."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                        ("MASTER_PORT", str(free_port))):
        os.environ.setdefault(name, value)
    if os.environ["WORLD_SIZE"] != "1":
        raise ValueError(f"{command} runs in one process; WORLD_SIZE is {os.environ['WORLD_SIZE']}")
    return dict(os.environ)
