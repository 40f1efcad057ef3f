"""Per-rank half of `flexrl logprobs`: one FlexUlysses forward over this rank's local tokens.

`rank_logprobs(job, rank, group_tree)` is plain (no spawning) and returns this rank's pieces:
{seq id: [(first position, log-probs of the next tokens at positions first..)]}. `RankProcesses`
starts N fresh processes (forked from a forkserver that pre-imported torch and transformers) that
join one process group (backend from flexrl_ds.parallel.device), load the model and, for
`--loader shadow`, join the Ray cluster — all before the step is known, while the controller loads
it; `run(job)` then hands them the step, gathers the pieces to rank 0 with `gather_object`, and
returns them; a crash or a hang (timeout) on any rank fails the whole call with that rank's
traceback. `spawn(job, N)` does both at once. With `job.shadow` each rank pulls its vision units'
pixels itself (flexrl_ds/runtime/rank_pixels.py).
"""

from __future__ import annotations

import os
import queue
import socket
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from flexrl_ds.runtime.pieces import assemble  # noqa: F401  (re-exported: callers import it from here)


PRELOAD = ("torch", "torch.distributed", "transformers", "flexrl_ds.models.flex_model",
           "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "transformers.models.qwen2.modeling_qwen2")


@dataclass
class LogprobJob:
    """Everything a rank needs (the same on all ranks)."""

    model_dir: str
    dtype: str
    plan_json: dict
    """The step's plan (plan-schema.md object)."""
    samples: dict[str, Any]
    """EncodedSample per sequence id (with `--loader shadow`, vision items hold placeholders)."""
    timeout_s: float = 600.0
    """Collective timeout of the process group, and of the whole spawned run."""
    shadow: Any = None
    """`shadow_inputs.ShadowHandle` (`--loader shadow`): each rank pulls its vision units' pixels from
    the preprocessing actors; None: the samples carry their pixels."""


def rank_logprobs(job: LogprobJob, rank: int, group_tree=None, device=None,
                  stats: dict[str, float] | None = None, model=None) -> dict[str, list]:
    """This rank's pieces of next-token log-probs (all local positions of its sequences).

    device: where the model runs (None: CPU). stats: if given, receives this rank's data figures
    (`pixel_bytes` it pulled, `wait_s` it waited for them, with `--loader shadow`). model: the HF
    model already loaded (on `device`); None: loaded here."""
    from flexrl_ds.planning.plan import parse_plan

    plan = parse_plan(job.plan_json)
    placement = _place(job, plan, rank, group_tree, model)
    pixels = _start_pixel_fetch(job, placement) if job.shadow is not None else None
    try:
        logprobs, batch = _forward(job, plan, rank, placement, device, pixels, model)
    finally:
        if pixels is not None:
            pixels.close()
    if stats is not None and pixels is not None:
        stats.update(pixels.stats)
    pieces: dict[str, list] = {}
    for seq_id, lo, hi, local in batch.layout.segments():
        pieces.setdefault(seq_id, []).append((lo, logprobs[local:local + hi - lo].tolist()))
    return pieces


def _place(job: LogprobJob, plan, rank: int, group_tree, model=None):
    """This rank's layout and vision route, once, from the model's config (no weights needed)."""
    import transformers

    from flexrl_ds.models.flex_model import place_rank

    config = model.config if model is not None else transformers.AutoConfig.from_pretrained(job.model_dir)
    return place_rank(config, plan, job.samples, rank, group_tree)


def _start_pixel_fetch(job: LogprobJob, placement):
    """Start pulling this rank's vision units (before its batch is built); None when it has none."""
    from flexrl_ds.runtime.rank_pixels import RankPixels

    return RankPixels(job.shadow, placement.units) if placement.units else None


def _forward(job: LogprobJob, plan, rank: int, placement, device, pixels, model=None):
    """Load the model (unless given), build this rank's batch (pixels from `pixels` if given), one
    no-grad forward."""
    from flexrl_ds.models.flex_model import FlexUlyssesLM, build_step_batch, positions_fn
    from flexrl_ds.parallel.device import use_full_precision_kernels
    from flexrl_ds.models.loading import load_model

    if model is None:
        model = load_model(job.model_dir, job.dtype)
        if device is not None:
            model = model.to(device)
    if job.dtype != "bfloat16":  # fp32/fp64 mean full precision: no TF32 kernels on GPUs
        use_full_precision_kernels()
    batch = build_step_batch(model.config, plan, job.samples, rank, positions=positions_fn(model),
                             placement=placement)
    if pixels is not None:
        batch.items = pixels.items(job.samples, batch.route.my_units)
    else:
        assert job.shadow is None or batch.route is None or not batch.route.my_units, "units without a fetch"
    with torch.no_grad():
        logprobs = FlexUlyssesLM(model)(batch).logprobs
    return logprobs, batch


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class RankSetup:
    """What ranks need before the step is known: they prepare while the controller loads the step."""

    model_dir: str
    """HF model directory each rank loads."""
    dtype: str = "float32"
    """Model dtype."""
    timeout_s: float = 600.0
    """Collective timeout, and the longest wait for the step or for the run's result."""
    ray_address: str | None = None
    """Ray cluster the ranks join as drivers (`--loader shadow`); None: no Ray in the ranks."""
    ray_namespace: str | None = None
    """Namespace of the controller's named actors."""


def _worker(rank: int, world_size: int, port: int, setup: RankSetup, jobs, results) -> None:
    """One rank: process group, model and Ray first; then wait for the step's job and run it."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import datetime

        import torch.distributed as dist

        from flexrl_ds.parallel import device as device_mod
        from flexrl_ds.parallel.group_tree import GroupTree, SPTopology
        from flexrl_ds.models.loading import load_model

        info = device_mod.detect()
        device = device_mod.set_local_device(info, rank)
        # Plain process group (no deepspeed.comm: the overlapped FlexUlysses path does not need it).
        dist.init_process_group(backend=info.backend, rank=rank, world_size=world_size,
                                init_method=f"tcp://127.0.0.1:{port}",
                                timeout=datetime.timedelta(seconds=setup.timeout_s))
        model = load_model(setup.model_dir, setup.dtype)
        model = model.to(device) if device is not None else model
        if setup.ray_address:
            import ray

            ray.init(address=setup.ray_address, namespace=setup.ray_namespace, log_to_driver=False,
                     configure_logging=False)
        job = jobs.get(timeout=setup.timeout_s)
        tree = GroupTree.create(SPTopology(world_size=world_size, domain_size=world_size,
                                           p_max=int(job.plan_json["p_max"])), rank)
        stats: dict[str, float] = {}
        pieces = rank_logprobs(job, rank, tree, device, stats, model=model)
        gathered = [None] * world_size if rank == 0 else None
        dist.gather_object((pieces, stats), gathered, dst=0)
        if rank == 0:
            results.put(("ok", gathered))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))


class RankProcesses:
    """`world_size` rank processes, started before the step is known so that joining the process
    group, loading the model and joining Ray overlap with the controller's loading of the step;
    `run(job)` hands every rank the step and returns (pieces, stats) per rank, in rank order. As a
    context manager, leaving it stops ranks still alive (a failed or abandoned run)."""

    def __init__(self, setup: RankSetup, world_size: int):
        import multiprocessing as mp

        # Fork the ranks from a server that imported torch/transformers once (not N times in parallel).
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOAD) + (["ray"] if setup.ray_address else []))
        self.setup, self.world_size = setup, world_size
        self._jobs, self._results = context.Queue(), context.Queue()
        port = _free_port()
        self._procs = [context.Process(target=_worker, args=(r, world_size, port, setup, self._jobs, self._results),
                                       daemon=True) for r in range(world_size)]
        for proc in self._procs:
            proc.start()

    def run(self, job: LogprobJob) -> list[tuple[dict[str, list], dict[str, float]]]:
        for _ in range(self.world_size):
            self._jobs.put(job)
        status, payload = "error", f"no rank: no result within {self.setup.timeout_s:.0f} s (hang or crash)"
        try:
            status, payload = self._results.get(timeout=self.setup.timeout_s)
        except queue.Empty:
            pass
        self._stop(grace_s=30 if status == "ok" else 1)
        if status != "ok":
            raise RuntimeError(f"flexrl logprobs failed on {payload}")
        return payload

    def _stop(self, grace_s: float) -> None:
        for proc in self._procs:
            proc.join(timeout=grace_s)
            if proc.is_alive():
                proc.kill()

    def __enter__(self) -> RankProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self._stop(grace_s=0.1)


def spawn(job: LogprobJob, world_size: int) -> list[tuple[dict[str, list], dict[str, float]]]:
    """Run `rank_logprobs` on `world_size` new processes; per rank (rank order): (pieces, stats)."""
    address, namespace = (job.shadow.ray_address, job.shadow.namespace) if job.shadow is not None else (None, None)
    with RankProcesses(RankSetup(job.model_dir, job.dtype, job.timeout_s, address, namespace), world_size) as ranks:
        return ranks.run(job)
