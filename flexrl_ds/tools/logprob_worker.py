"""Per-rank half of `flexrl logprobs`: one FlexUlysses forward over this rank's local tokens.

`rank_logprobs(job, rank, group_tree)` is plain (no process group of its own) and returns this
rank's pieces: {seq id: [(first position, log-probs of the next tokens at positions first..)]}.
`LogprobWorker(place, setup)` is the rank as a worker of a runtime/ worker group: built before the
step is known (joins the group's process group, backend from flexrl_ds.parallel.device, loads the
model), so that this overlaps the parent's loading of the step; `logprobs(job)` then runs the
step and returns (pieces, stats). The tool hosts it in a `RayWorkerGroup` (`--loader shadow`: one
Ray actor per rank, pulling its vision units' pixels itself through the job's `PixelSource`,
flexrl_ds/runtime/rank_pixels.py) or a `ProcessWorkerGroup` (`--loader local`: forked processes,
every sample with its pixels in the job).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from flexrl_ds.loader.metastore import PromptKey
from flexrl_ds.models.flex_model import FlexUlyssesLM, build_step_batch, place_rank, positions_fn
from flexrl_ds.models.loading import load_model
from flexrl_ds.parallel import device as device_mod
from flexrl_ds.parallel.group_tree import GroupTree, SPTopology
from flexrl_ds.planning.plan import parse_plan
from flexrl_ds.runtime.pieces import assemble  # noqa: F401  (re-exported: callers import it from here)
from flexrl_ds.runtime.rank_pixels import RankPixels
from flexrl_ds.runtime.worker_group import WorkerPlace, join_process_group

PRELOAD = ("torch", "torch.distributed", "transformers", "flexrl_ds.models.flex_model",
           "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "transformers.models.qwen3_vl.modeling_qwen3_vl",
           "transformers.models.qwen2.modeling_qwen2")
"""Modules the forkserver of a `ProcessWorkerGroup` imports once for all ranks."""


@dataclass
class LogprobJob:
    """Everything a rank needs for the step (the same on all ranks)."""

    model_dir: str
    dtype: str
    plan_json: dict
    """The step's plan (docs/PLAN_SCHEMA.md object)."""
    samples: dict[str, Any]
    """EncodedSample per sequence id (with a `pixels` source, vision items hold placeholders)."""
    timeout_s: float = 600.0
    """Longest wait for the rank's pixels."""
    pixels: Any = None
    """The run's `PixelSource` (`--loader shadow`): each rank pulls its vision units' pixels from
    the preprocessing actors; None: the samples carry their pixels."""
    step: int = 0
    """Loader step the pixels belong to (with `pixels`)."""
    prompt_keys: dict[str, PromptKey] = field(default_factory=dict)
    """Sequence id -> its prompt's key, where its pixels live (with `pixels`)."""
    logprob_chunk_bytes: int = 1 << 30
    """`flexrl.sp.logprob_chunk_bytes` of `--config`: the byte budget of one LM-head chunk."""


def rank_logprobs(job: LogprobJob, rank: int, group_tree=None, device=None,
                  stats: dict[str, float] | None = None, model=None) -> dict[str, list]:
    """This rank's pieces of next-token log-probs (all local positions of its sequences).

    device: where the model runs (None: CPU). stats: if given, receives this rank's data figures
    (`pixel_bytes` it pulled, `wait_s` it waited for them, `num_repairs`, with `job.pixels`).
    model: the HF model already loaded (on `device`); None: loaded here."""
    import transformers

    plan = parse_plan(job.plan_json)
    config = model.config if model is not None else transformers.AutoConfig.from_pretrained(job.model_dir)
    placement = place_rank(config, plan, job.samples, rank, group_tree)  # once: layout, route, units
    pixels = None
    if job.pixels is not None and placement.units:  # start the pull before the model and batch
        pixels = RankPixels(job.pixels, job.step, job.prompt_keys, placement.units)
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


def _forward(job: LogprobJob, plan, rank: int, placement, device, pixels, model=None):
    """Load the model (unless given), build this rank's batch (pixels from `pixels` if given), one
    no-grad forward."""
    if model is None:
        model = load_model(job.model_dir, job.dtype)
        if device is not None:
            model = model.to(device)
    if job.dtype != "bfloat16":  # fp32/fp64 mean full precision: no TF32 kernels on GPUs
        device_mod.use_full_precision_kernels()
    batch = build_step_batch(model.config, plan, job.samples, rank, positions=positions_fn(model),
                             placement=placement)
    if pixels is not None:
        batch.items = pixels.items(job.samples, batch.route.my_units)
    else:
        assert job.pixels is None or batch.route is None or not batch.route.my_units, "units without a fetch"
    with torch.no_grad():
        logprobs = FlexUlyssesLM(model, logits_chunk_bytes=job.logprob_chunk_bytes)(batch).logprobs
    return logprobs, batch


@dataclass(frozen=True)
class RankSetup:
    """What ranks need before the step is known: they prepare while the parent loads the step."""

    model_dir: str
    """HF model directory each rank loads."""
    dtype: str = "float32"
    """Model dtype."""
    timeout_s: float = 600.0
    """Collective timeout of the ranks' process group."""


class LogprobWorker:
    """One rank of `flexrl logprobs` in a worker group: process group and model, then steps."""

    def __init__(self, place: WorkerPlace, setup: RankSetup):
        self.place, self.setup = place, setup
        os.environ.update(RANK=str(place.rank), WORLD_SIZE=str(place.world_size), LOCAL_RANK=str(place.local_rank),
                          MASTER_ADDR=place.master_addr, MASTER_PORT=str(place.master_port))
        info = device_mod.detect()
        self.device = device_mod.set_local_device(info, place.local_rank)
        # Plain process group (no deepspeed.comm: the overlapped FlexUlysses path does not need it).
        join_process_group(place, info.backend, setup.timeout_s)
        model = load_model(setup.model_dir, setup.dtype)
        self.model = model.to(self.device) if self.device is not None else model

    def logprobs(self, job: LogprobJob) -> tuple[dict[str, list], dict[str, float]]:
        """This rank's (pieces, stats) of the step (collective: every rank is called)."""
        world = self.place.world_size
        tree = GroupTree.create(SPTopology(world_size=world, domain_size=world, p_max=int(job.plan_json["p_max"])),
                                self.place.rank)
        stats: dict[str, float] = {}
        pieces = rank_logprobs(job, self.place.rank, tree, self.device, stats, model=self.model)
        return pieces, stats
