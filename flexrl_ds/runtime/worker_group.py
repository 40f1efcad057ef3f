"""Worker groups: one object that owns where a group's ranks run and calls a method on all of them.

A worker is a plain class (testable without Ray) whose constructor takes `WorkerPlace` first: its
rank, the group's size, the rendezvous address and port. Two groups run the same worker class:

- `RayWorkerGroup`: one Ray actor per rank, placed by a placement group (one bundle per rank,
  `PACK` strategy), the rendezvous store hosted by rank 0's actor. This is the `flexrl
  train` driver's path (a local Ray, or a cluster under `ray job submit`).
- `SPMDWorkerGroup`: the processes a launcher started (`deepspeed --hostfile`, torchrun): every
  process holds its own worker; rank 0 runs the driver and `run(...)` broadcasts the call to the
  other ranks, which wait in `serve()`; results come back to rank 0 with `gather_object`.

The rendezvous store is opened on a port the OS picks, by whoever hosts it (rank 0's actor, or
`ProcessWorkerGroup`'s parent), before any rank joins: `join_process_group` connects to it (or uses
it, in the process that hosts it), so no other process can take the port between its choice and
its bind.

Both give `run(method, *args, **kwargs) -> [result of rank 0, ..., rank N-1]` with the same
arguments on every rank (collective methods, e.g. a ZeRO-3 forward), and `run_each(method,
per_rank_args)` with one argument tuple per rank. `method` is the worker class's method itself
(`group.run(PolicyWorker.logprobs, job)`), never its name: the group sends its `__name__` and
refuses a method of another class (`remote_name`).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch.distributed as dist

from flexrl_ds.common import notes
from flexrl_ds.parallel import device as device_mod
from flexrl_ds.parallel import network
from flexrl_ds.runtime import spmd_failures
from flexrl_ds.runtime.host_threads import ranks_per_node
from flexrl_ds.runtime.rank_failures import LostRanks, first_line, wait_ranks

logger = logging.getLogger(__package__)


@dataclass(frozen=True)
class WorkerPlace:
    """Where one worker sits in its group."""

    rank: int
    """Rank within the group, 0..world_size-1."""
    world_size: int
    """Ranks in the group."""
    master_addr: str
    """Rendezvous host of the group's process group (rank 0's node)."""
    master_port: int
    """Rendezvous port."""
    local_rank: int = 0
    """Rank on this node (selects the GPU)."""
    node_id: str = ""
    """Ray node id (hex) the worker runs on ("" outside Ray): where its pixels should be decoded."""
    ranks_on_node: int = 1
    """Ranks of the group on this worker's node (they share its cores: runtime/host_threads.py)."""


def remote_name(worker_class: type | None, method: Callable[..., Any]) -> str:
    """The name a group sends to its ranks for `method`, a method of the worker class
    (`PolicyWorker.logprobs`); a TypeError for a name given as a string or a method of another class.
    `worker_class` None (a group built by a factory function): any function is taken."""
    if isinstance(method, str) or not hasattr(method, "__name__"):
        raise TypeError(f"worker group: pass the worker's method itself (e.g. Worker.{method}), not {method!r}")
    name = method.__name__
    if worker_class is not None and getattr(worker_class, name, None) != method:
        raise TypeError(f"worker group: {getattr(method, '__qualname__', name)} is not a method of the group's "
                        f"worker class {worker_class.__name__}")
    return name


def open_store(host: str, size: int, timeout_s: float) -> dist.TCPStore:
    """A TCPStore hosted here on a port the OS picks (no race between choosing and binding it),
    listening on `host` only (torch's own would listen on every interface: parallel/network.py);
    `size` processes connect to it at `host`:`store.port`."""
    listener = network.listening_socket(host)
    port = listener.getsockname()[1]
    return dist.TCPStore(host, port, size, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=listener.detach())


_HOSTED_STORES: dict[tuple[str, int], dist.TCPStore] = {}
"""Rendezvous stores this process hosts (`host_rendezvous`), by (address, port)."""


def host_rendezvous(address: str, world_size: int, timeout_s: float) -> int:
    """Host a group's rendezvous store in this process, for as long as the process lives; its port."""
    store = open_store(address, world_size, timeout_s)
    _HOSTED_STORES[(address, store.port)] = store
    return store.port


def join_process_group(place: WorkerPlace, backend: str, timeout_s: float) -> None:
    """Join the group's default process group through its rendezvous store at `place`'s address."""
    timeout = datetime.timedelta(seconds=timeout_s)
    device_mod.pin_collectives(place.master_addr)
    store = _HOSTED_STORES.get((place.master_addr, place.master_port))
    if store is None:
        store = dist.TCPStore(place.master_addr, place.master_port, place.world_size, is_master=False,
                              timeout=timeout)
    dist.init_process_group(backend=backend, store=store, rank=place.rank, world_size=place.world_size,
                            timeout=timeout)


def node_address() -> str:
    """This node's address as Ray sees it (127.0.0.1 without Ray)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def print_worker_notes(actors: Sequence[Any], timeout_s: float = 5.0) -> None:
    """Print on this console, once each, the lines the actors' workers said since last asked
    (common/notes.py; each actor's body has `take_notes`). Called in `finally` blocks, so it never
    raises: an actor that does not answer within `timeout_s` (lost, or still busy in a hang), or a
    Ray that is gone, is skipped, and its lines stay in its log file."""
    print_said_lines(taken_notes(actors, timeout_s))


def taken_notes(actors: Sequence[Any], timeout_s: float) -> list:
    """Each answering actor's lines since last asked (`print_worker_notes`); never raises."""
    if not actors:
        return []  # ray.wait would start a Ray of its own
    try:
        refs = [actor.take_notes.remote() for actor in actors]
    except Exception:  # noqa: BLE001 - e.g. Ray is gone; never hide the error these notes follow
        return []
    return answered(refs, timeout_s)


def answered(refs: list, timeout_s: float) -> list:
    """The values of those of `refs` that answer within `timeout_s`, in order; a failed or lost
    call is skipped (its actor's lines stay in its log file). Never raises: it runs after the
    call it serves has failed, and must not hide that error."""
    import ray

    try:
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    except Exception:  # noqa: BLE001
        return []
    values = []
    for ref in (ref for ref in refs if ref in ready):
        try:
            values.append(ray.get(ref))
        except Exception:  # noqa: BLE001
            continue
    return values


def print_said_lines(said: Sequence[Sequence[str]]) -> None:
    """Log each actor's lines at INFO (they were kept at the actors' level, FLEXRL_LOG_LEVEL as here),
    in actor order; a line several actors said, once."""
    printed: set[str] = set()
    for lines in said:
        for line in lines:
            if line not in printed:
                printed.add(line)
                logger.info(line)


class _Host(notes.NoteKeeper):
    """The Ray actor body: builds the worker once the group's rendezvous is known."""

    def __init__(self):
        super().__init__()
        self.worker = None

    def rendezvous(self, world_size: int, timeout_s: float) -> tuple[str, int]:
        address = node_address()
        address = address if address != "localhost" else "127.0.0.1"
        return address, host_rendezvous(address, world_size, timeout_s)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        return os.getpid()

    def start(self, place: WorkerPlace, factory: Callable[..., Any], kwargs: dict) -> tuple[bool, list[str]]:
        """Build the worker; True and the lines said while it was built."""
        self.worker = factory(place, **kwargs)
        return True, self.take_notes()

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def call_and_take_notes(self, method: str, args: tuple, kwargs: dict) -> tuple[Any, list[str]]:
        """The call's result and the lines said up to its end, in one round trip."""
        return self.call(method, args, kwargs), self.take_notes()


class RayWorkerGroup:
    """`num_ranks` Ray actors, each holding one worker built by `factory(place, **kwargs)`."""

    def __init__(self, factory: Callable[..., Any], num_ranks: int, kwargs: dict | None = None,
                 num_cpus_per_rank: float = 1.0, num_gpus_per_rank: float = 0.0, name: str = "workers",
                 timeout_s: float = 900.0, env: dict[str, str] | None = None, memory_hint: str = "",
                 collective_timeout_s: float | None = None):
        """memory_hint: what of this group's work lives in host memory, said if Ray kills a rank
        for host memory (runtime/lost_workers.py). collective_timeout_s: the ranks' process-group
        timeout (default `timeout_s`): after a rank fails, how long the others may take to fail too."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if num_ranks < 1:
            raise ValueError(f"{name}: a worker group needs at least one rank, got {num_ranks}")
        self.name, self.num_ranks, self.timeout_s, self.memory_hint = name, num_ranks, timeout_s, memory_hint
        self.worker_class = factory if isinstance(factory, type) else None
        self.collective_timeout_s = collective_timeout_s or timeout_s
        bundle = {"CPU": num_cpus_per_rank, **({"GPU": num_gpus_per_rank} if num_gpus_per_rank else {})}
        self.placement = placement_group([dict(bundle) for _ in range(num_ranks)], strategy="PACK")
        ray.get(self.placement.ready(), timeout=timeout_s)
        actor_cls = ray.remote(_Host)
        runtime_env = {"env_vars": dict(env)} if env else None
        self.actors = [
            actor_cls.options(num_cpus=num_cpus_per_rank, num_gpus=num_gpus_per_rank, runtime_env=runtime_env,
                              scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, index)).remote()
            for index in range(num_ranks)]
        address, port = ray.get(self.actors[0].rendezvous.remote(num_ranks, timeout_s), timeout=timeout_s)
        self.node_ids: list[str] = ray.get([actor.node_id.remote() for actor in self.actors], timeout=timeout_s)
        """Ray node id of each rank, in rank order (where the group's consumers of pixels run)."""
        self.pids: list[int] = ray.get([actor.pid.remote() for actor in self.actors], timeout=timeout_s)
        """Each rank's process id (named when a rank is lost)."""
        # Ray gives each actor its own GPU(s) (CUDA_VISIBLE_DEVICES): local device 0 in every actor.
        places = [WorkerPlace(rank, num_ranks, address, port, local_rank=0, node_id=node, ranks_on_node=sharing)
                  for rank, (node, sharing) in enumerate(zip(self.node_ids, ranks_per_node(self.node_ids)))]
        self._get([actor.start.remote(place, factory, kwargs or {}) for actor, place in zip(self.actors, places)],
                  "start")

    def _get(self, refs: list, what: str) -> list:
        """The results of calls that return (result, lines said), in rank order, the lines printed
        here: a call that succeeds costs no second round trip; after a failure every rank is asked."""
        try:
            answers = self._wait(refs, what)
        except BaseException:  # the ranks that finished returned their lines; the others still hold theirs
            finished = [lines for _, lines in answered(refs, timeout_s=5.0)]
            print_said_lines(finished + taken_notes(self.actors, 5.0))
            raise
        print_said_lines([lines for _, lines in answers])
        return [result for result, _ in answers]

    def _wait(self, refs: list, what: str) -> list:
        """Every rank's result; a rank lost (died, or stalled while the others failed in a collective)
        raises `LostRanks` naming it and what each survivor saw (runtime/rank_failures.py)."""
        return wait_ranks(refs, f"{self.name}.{what}", self.timeout_s, self.collective_timeout_s, self.memory_hint,
                          self.pids)

    def _start(self, host_method: str, method: Callable[..., Any], calls: Sequence[tuple[tuple, dict]]) -> list:
        """`_Host.<host_method>(method's name, args, kwargs)` on each rank with its (args, kwargs)."""
        name = remote_name(self.worker_class, method)
        return [getattr(actor, host_method).remote(name, args, kwargs)
                for actor, (args, kwargs) in zip(self.actors, calls)]

    def _each(self, per_rank: Sequence[tuple]) -> list[tuple[tuple, dict]]:
        assert len(per_rank) == self.num_ranks, (len(per_rank), self.num_ranks)
        return [(tuple(args), {}) for args in per_rank]

    def run_async(self, method: Callable[..., Any], *args, **kwargs) -> list:
        """Start `method(*args, **kwargs)` on every rank; the Ray references, in rank order. The
        caller waits for them, and prints what the ranks said (`print_worker_notes`)."""
        return self._start("call", method, [(args, kwargs)] * self.num_ranks)

    def run(self, method: Callable[..., Any], *args, **kwargs) -> list:
        """`method(*args, **kwargs)` on every rank (the same arguments); results in rank order."""
        calls = [(args, kwargs)] * self.num_ranks
        return self._get(self._start("call_and_take_notes", method, calls), method.__name__)

    def note_step(self, step: int) -> None:
        """The driver's step (an SPMD group names it with a lost rank; here Ray's errors carry the call
        and the driver adds the step)."""

    def run_each_async(self, method: Callable[..., Any], per_rank: Sequence[tuple]) -> list:
        """Start `method(*per_rank[r])` on rank r; the Ray references, in rank order (calls from one
        caller run on each rank in the order they were started)."""
        return self._start("call", method, self._each(per_rank))

    def run_each(self, method: Callable[..., Any], per_rank: Sequence[tuple]) -> list:
        """`method(*per_rank[r])` on rank r; results in rank order."""
        return self._get(self._start("call_and_take_notes", method, self._each(per_rank)), method.__name__)

    def shutdown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self.placement)
        self.actors = []


_STOP = "__stop__"


class SPMDWorkerGroup:
    """The launcher's processes as a worker group: every process holds its worker, rank 0 drives.

    Build it on every rank after `torch.distributed` is initialised (the launcher's environment,
    `parallel.launch.init_distributed`); rank 0 calls `run`/`run_each`, the others call `serve()`,
    which returns after rank 0's `shutdown()`. A lost rank is named by every survivor with the step
    (runtime/spmd_failures.py): rank 0's call raises `LostRanks`, the others say their line."""

    def __init__(self, worker: Any, rank: int, world_size: int, group: Any = None, name: str = "policy"):
        self.worker, self.rank, self.num_ranks, self.group, self.name = worker, rank, world_size, group, name
        self.places = spmd_failures.gather_places(group)
        """Every rank's pid and host, to name a lost one."""
        self.step: int | None = None
        """The driver's step (`note_step`; the other ranks learn it with each call)."""
        self.broken = False
        """A call failed: the group's collectives are not to be used again (`shutdown` sends nothing)."""
        self.resume_from: Callable[[], str] | None = None
        """The checkpoint a --resume would continue from, named in a survivor's line (`name_losses_when_stopped`)."""

    def note_step(self, step: int) -> None:
        """The step the driver's next calls belong to (named if a rank is lost)."""
        self.step = step

    def _broadcast(self, message: Any) -> Any:
        import torch.distributed as dist

        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _execute(self, message: tuple) -> list | None:
        import torch.distributed as dist

        method, per_rank, kwargs, self.step = message
        result = getattr(self.worker, method)(*per_rank[self.rank], **kwargs)
        gathered = [None] * self.num_ranks if self.rank == 0 else None
        dist.gather_object(result, gathered, dst=0, group=self.group)
        return gathered

    def _drive(self, name: str, per_rank: list, kwargs: dict) -> list:
        started = time.monotonic()
        try:
            return self._execute(self._broadcast((name, per_rank, kwargs, self.step))) or []
        except Exception as error:
            self.broken = True
            lost = spmd_failures.lost_peers_settled(self.places, self.rank)
            if not lost:
                raise
            raise LostRanks(f"{self.name}.{name}", lost, {0: first_line(error)},
                            time.monotonic() - started) from error

    def run(self, method: Callable[..., Any], *args, **kwargs) -> list:
        assert self.rank == 0, "only rank 0 drives an SPMD group"
        return self._drive(remote_name(type(self.worker), method), [args] * self.num_ranks, kwargs)

    def run_each(self, method: Callable[..., Any], per_rank: Sequence[tuple]) -> list:
        assert self.rank == 0 and len(per_rank) == self.num_ranks
        return self._drive(remote_name(type(self.worker), method), [tuple(a) for a in per_rank], {})

    def serve(self) -> None:
        """Ranks other than 0: execute rank 0's calls until it shuts the group down; a failed call
        (a lost rank) is said with the lost rank and the step before it is raised."""
        try:
            while (message := self._broadcast(None)) != _STOP:
                self._execute(message)
        except Exception as error:
            print(self.survivor_line(first_line(error), settle_s=spmd_failures.SETTLE_S), flush=True)
            raise

    def survivor_line(self, seen: str, stopped: bool = False, settle_s: float = 0.0) -> str:
        """This rank's line as a survivor: the ranks lost as it sees them, the step, `seen`; `settle_s`:
        after a failed collective, how long a dying peer is given to read as gone (`lost_peers_settled`)."""
        lost = spmd_failures.lost_peers_settled(self.places, self.rank, settle_s)
        resume_from = self.resume_from() if self.resume_from is not None else None
        return spmd_failures.survivor_line(self.rank, self.step, lost, seen, stopped, resume_from)

    def name_losses_when_stopped(self, resume_from: Callable[[], str] | None = None) -> None:
        """On the launcher's SIGTERM (it stops every rank when one fails), say this rank's survivor
        line and exit (runtime/spmd_failures.py; main thread only); `resume_from`: the checkpoint a
        --resume would continue from, asked when the line is said ("": none)."""
        self.resume_from = resume_from
        spmd_failures.on_launcher_stop(lambda: self.survivor_line("the launcher stopped it (SIGTERM)", stopped=True))

    def shutdown(self) -> None:
        if self.rank == 0 and not self.broken:
            self._broadcast(_STOP)
