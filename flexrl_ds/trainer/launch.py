"""`flexrl train`: build a run's groups and drive it, under Ray or under a launcher.

- Ray (default): this process is the driver. It joins the cluster of RAY_ADDRESS (as under
  `ray job submit`) or starts a local one, starts the data controller (preprocessing actors), the
  policy group (one Ray actor per rank, `runtime/worker_group.RayWorkerGroup`) and the rollout
  engines (inside the policy ranks when `flexrl.trainer.colocate`, else Ray actors of their own).
- SPMD (`--spmd`, what scripts/train_deepspeed.sh passes under `deepspeed --hostfile`): every
  launched process is a policy rank; rank 0 also plays the driver (metadata, planning, rewards) and
  starts or joins Ray for the preprocessing actors; rollout is colocated in the ranks.
Everything that can be checked is checked before any worker starts (trainer/validation.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch.distributed as dist
import transformers

from flexrl_ds.families import family_of
from flexrl_ds.common.json_files import read_json
from flexrl_ds.common.overrides import apply_overrides
from flexrl_ds.media.config import replaced_by_processor
from flexrl_ds.media.records import read_dataset
from flexrl_ds.parallel.launch import init_distributed
from flexrl_ds.models.flops import DecoderShape, VisionShape, peak_bf16_flops
from flexrl_ds.models.step_floor import peak_hbm_bytes
from flexrl_ds.models.processing import SampleEncoder
from flexrl_ds.models.zero3 import with_schedule_length
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.rl.reward_fn import load_reward_fn
from flexrl_ds.rollout.base import SamplingParams, stop_token_ids
from flexrl_ds.runtime.data_controller import DataController, usable_records
from flexrl_ds.runtime.host_threads import configured_host_threads
from flexrl_ds.runtime.rank_failures import LostRanks, is_lost_worker
from flexrl_ds.runtime.ray_session import connect_ray, ray_address
from flexrl_ds.runtime.worker_group import RayWorkerGroup, SPMDWorkerGroup, WorkerPlace
from flexrl_ds.trainer.checkpoint import (check_out_dir, latest_checkpoint, read_trainer_state, resume_checkpoint,
                                         resume_config_note)
from flexrl_ds.trainer.driver import GRPOTrainer, TrainOptions
from flexrl_ds.trainer.memory_check import check_memory
from flexrl_ds.trainer.floor_metrics import job_gpus
from flexrl_ds.trainer.metrics import StepLog
from flexrl_ds.trainer.policy_worker import PolicySetup, PolicyWorker
from flexrl_ds.trainer.rl_step import resolved_rl
from flexrl_ds.trainer.rollout_group import ColocatedRollout, RestartBudget, SeparateRollout
if TYPE_CHECKING:
    from flexrl_ds.loader.config import DataConfig
    from flexrl_ds.rl.reward_fn import RewardFn
    from flexrl_ds.runtime.data_controller import PixelSource
from flexrl_ds.trainer.validation import (check_run, gradient_accumulation_dtype, ignored_settings, model_dtype,
                                         resolve_media_limits)

logger = logging.getLogger(__package__)


@dataclass
class TrainArgs:
    """The command line of `flexrl train`."""

    config_path: str
    model_dir: str
    data_path: str
    out_dir: str
    max_steps: int | None = None
    resume: bool = False
    spmd: bool = False
    overrides: tuple[str, ...] = ()
    """`--set KEY.PATH=VALUE`s, applied over the config file (common/overrides.apply_overrides)."""


@dataclass
class Prepared:
    """A run's inputs, checked, before any worker starts."""

    run: Any
    """The run config (`config.flexrl_config.RunConfig`; config/ imports trainer/, so not named here)."""
    args: TrainArgs
    data_config: DataConfig
    records: list
    encoder: SampleEncoder
    reward_fn: RewardFn
    num_ranks: int
    max_steps: int
    checkpoint: Path | None = None
    """The checkpoint --resume continues from (None: start at step 0)."""
    start_step: int = 0
    """The first step to run (0-based)."""
    decoder: DecoderShape | None = None
    """The language model's shape (the `mfu` metric's FLOPs)."""
    vision: VisionShape | None = None
    """Its vision tower's (None for a text model)."""


def prepare(run: Any, args: TrainArgs, num_ranks: int | None = None) -> Prepared:
    """Validate the config, the model, the reward and the dataset (no Ray, no workers yet)."""
    trainer = run.flexrl.trainer
    num_ranks = num_ranks or trainer.num_policy_ranks
    for note in ignored_settings(run.flexrl, spmd_world=num_ranks if args.spmd else None):
        logger.info(note)  # first: the checks below judge the run by what replaced them
    check_run(run, args.model_dir, num_ranks)
    check_memory(run, args.model_dir, num_ranks, spmd=args.spmd)  # refused here if it cannot fit (memory_check)
    ray_address()  # a job server's URL in RAY_ADDRESS is refused here, before anything starts
    check_out_dir(Path(args.out_dir), args.resume)
    data_config = run.flexrl.data.with_processor_dir(args.model_dir)
    records = usable_records(read_dataset(args.data_path, data_config.media_root), args.data_path)
    if data_config.loader.global_batch > len(records):
        raise ValueError(f"flexrl.data.loader.global_batch: {data_config.loader.global_batch} prompts a step, "
                         f"more than the {len(records)} rows of {args.data_path}")
    run.flexrl.rollout = resolve_media_limits(run.flexrl.rollout, records)  # the engines are built from it
    run.flexrl.rl = resolved_rl(run.flexrl)  # defaults from other sections (trainer/rl_step.py)
    notes = replaced_by_processor(run.flexrl.data, data_config, args.model_dir)
    for note in notes + [run.flexrl.rollout.logprob_diff_caveat() or ""]:
        if note:
            logger.info(note)
    encoder = SampleEncoder(args.model_dir)
    reward_fn = load_reward_fn(run.flexrl.rl.reward_fn, base_dir=str(Path(args.config_path).resolve().parent))
    max_steps = args.max_steps if args.max_steps is not None else trainer.max_steps
    if max_steps < 1:
        raise ValueError(f"--max-steps must be at least 1, got {max_steps}")
    checkpoint, start_step = resume_point(args)
    rl = run.flexrl.rl
    run.deepspeed = with_schedule_length(run.deepspeed, max_steps * rl.mini_batches_per_step * rl.ppo_epochs)
    model_config = transformers.AutoConfig.from_pretrained(args.model_dir)
    vision_config = getattr(model_config, "vision_config", None)
    return Prepared(run, args, data_config, records, encoder, reward_fn, num_ranks, max_steps, checkpoint, start_step,
                    DecoderShape.from_config(model_config.get_text_config()),
                    None if vision_config is None else VisionShape.from_config(vision_config, family_of(model_config)))


def policy_setup(run: Any, model_dir: str, pixels: PixelSource, colocated: bool) -> PolicySetup:
    return PolicySetup(
        model_dir=model_dir, ds_config=run.deepspeed, p_max=run.flexrl.sp.p_max, overlap=run.flexrl.sp.overlap,
        domain_size=run.flexrl.sp.domain_size,
        rl=run.flexrl.rl,
        pixels=pixels, dtype=model_dtype(run.deepspeed), timeout_s=run.flexrl.trainer.group_timeout_s,
        seed=run.flexrl.trainer.seed, rollout_backend=run.flexrl.rollout.backend if colocated else None,
        max_batch_sequences=run.flexrl.rollout.max_batch_sequences,
        activation_checkpointing=run.flexrl.trainer.activation_checkpointing,
        zero3_leaf_layers=run.flexrl.trainer.zero3_leaf_layers, vision_attention=run.flexrl.trainer.vision_attention,
        offload_states_in_rollout=run.flexrl.trainer.offload_states_in_rollout,
        reference_offload_param=run.flexrl.trainer.reference_offload_param,
        logprob_temperature=run.flexrl.rollout.temperature, logprob_chunk_bytes=run.flexrl.sp.logprob_chunk_bytes,
        rollout_options=run.flexrl.rollout.engine_options(colocated=True) if colocated else {},
        host_threads=configured_host_threads(run.flexrl.trainer.host_threads_per_rank),
        loader_cpus_per_node=run.flexrl.data.pool.cpus_per_node)


def train_options(prepared: Prepared, raw_config: dict, device_name: str | None) -> TrainOptions:
    """`device_name`: the policy ranks' GPU (None on CPU)."""
    run, trainer = prepared.run, prepared.run.flexrl.trainer
    eos_ids = stop_token_ids(prepared.encoder.tokenizer.eos_token_id, prepared.args.model_dir)
    # On a GPU the shipped calibration matching it (flexrl.sp.calibration "auto") gives the planner
    # its step-time model; elsewhere the FLOP formula.
    cost = load_cost_model(run.flexrl.sp.cost_model or prepared.args.model_dir, run.flexrl.sp.calibration,
                           device_name=device_name)
    return TrainOptions(
        out_dir=Path(prepared.args.out_dir), max_steps=prepared.max_steps, start_step=prepared.start_step,
        seed=trainer.seed,
        save_every=trainer.save_every, save_last=trainer.save_last, save_rollouts=trainer.save_rollouts,
        sampling=SamplingParams.from_config(run.flexrl.rollout, eos_ids, vision_token_ids(prepared.args.model_dir)),
        rl=run.flexrl.rl, sp=run.flexrl.sp,
        cost=cost, num_ranks=prepared.num_ranks, bucket_bytes=trainer.weight_sync_bucket_mb * 2**20,
        run_config=raw_config, decoder=prepared.decoder, vision=prepared.vision,
        peak_flops=peak_bf16_flops(device_name),
        peak_bytes_per_s=peak_hbm_bytes(device_name), floor_gpus=job_gpus(run, prepared.num_ranks),
        loading=run.flexrl.data.loading,
        profile_step=trainer.profile_step, grad_accum_dtype=gradient_accumulation_dtype(run.deepspeed),
        memory_hint=policy_memory_hint(run), resume_from=prepared.checkpoint)


def vision_token_ids(model_dir: str) -> list[int]:
    """The model's vision placeholder and marker tokens (never sampled into a response)."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [int(getattr(config, name)) for name in names if getattr(config, name, None) is not None]


def resume_point(args: TrainArgs) -> tuple[Path | None, int]:
    """(checkpoint to load, first step to run)."""
    if not args.resume:
        return None, 0
    checkpoint, passed_over = resume_checkpoint(Path(args.out_dir))
    for line in passed_over:
        print(f"--resume: checkpoints/{line}: not resumable, passed over for the one before it", flush=True)
    if checkpoint is None:
        logger.info(f"--resume: no checkpoint under {args.out_dir}/checkpoints; starting from the first step")
        return None, 0
    state = read_trainer_state(checkpoint)
    logger.info(f"--resume: continuing after step {state['step'] + 1} (files: step_{state['step']}) from {checkpoint}")
    if isinstance(state.get("run_config"), dict):
        note = resume_config_note(state["run_config"],
                                  apply_overrides(read_json(args.config_path, "config file"), args.overrides))
        if note:
            logger.info(note)
    return checkpoint, state["step"] + 1


def nothing_to_do(prepared: Prepared) -> bool:
    """True (and says so) when --resume found a checkpoint at or after the last step asked for."""
    start = prepared.start_step
    if start < prepared.max_steps:
        return False
    logger.info(f"nothing to do: the checkpoint is after step {start}/{prepared.max_steps} (files: step_{start - 1}); "
                "raise --max-steps to train on")
    return True


def drive(prepared: Prepared, controller: DataController, policy: RayWorkerGroup | SPMDWorkerGroup,
          rollout: ColocatedRollout | SeparateRollout, raw_config: dict, restarts: int = 0) -> int:
    """Resume if asked, run the steps, close the log; `restarts`: the workers rebuilt so far (metrics)."""
    checkpoint, start = prepared.checkpoint, prepared.start_step
    rollout_config = prepared.run.flexrl.rollout
    if checkpoint is not None:
        policy.run(PolicyWorker.load_checkpoint, str(checkpoint))
        controller.skip_steps(start)
    colocated = isinstance(rollout, ColocatedRollout)
    if checkpoint is not None or rollout_config.engines_start_without_policy_weights(colocated):
        # the engines must start from the policy's weights: a checkpoint's, or the model's over random,
        # dropped or never loaded ones (colocated at sleep_level 2: RolloutConfig.engine_options)
        bucket_bytes = prepared.run.flexrl.trainer.weight_sync_bucket_mb * 2**20
        seconds = rollout.sync(policy, bucket_bytes)  # type: ignore[arg-type]  # separate engines: a Ray group
        logger.info(f"flexrl train: rollout engines given the policy's weights before step {start + 1} in "
                    f"{seconds:.1f} s")
    trainer_config = prepared.run.flexrl.trainer
    if trainer_config.reference_offload_param:  # what the engines were built with, as the ranks report it
        on_host = policy.run(PolicyWorker.reference_params_on_host)
        logger.info(f"flexrl train: the reference model's parameters wait in host memory (DeepSpeed offload_param) on "
                    f"{sum(on_host)} of {len(on_host)} policy ranks")
    log = StepLog(prepared.args.out_dir, resume_after_step=start - 1 if checkpoint is not None else None,
                  tensorboard=trainer_config.tensorboard, wandb_project=trainer_config.wandb_project)
    options = train_options(prepared, raw_config, device_name=policy.run(PolicyWorker.accelerator_name)[0])
    options = dataclasses.replace(options, restarts=restarts)
    try:
        GRPOTrainer(options, prepared.encoder, prepared.reward_fn, controller, policy, rollout, log).run()
    finally:
        log.close()
    logger.info(f"flexrl train: done; metrics in {Path(prepared.args.out_dir) / 'metrics.jsonl'}")
    return 0


def _progress(what: str, since: float) -> float:
    """Say what is ready and how long it took; returns now (the next part's start)."""
    now = time.perf_counter()
    logger.info(f"flexrl train: {what} in {now - since:.1f} s")
    return now


def policy_ranks(count: int) -> str:
    """"1 policy rank", "4 policy ranks"."""
    return f"{count} policy rank{'' if count == 1 else 's'}"


def policy_memory_hint(run: Any) -> str:
    """What of a policy rank lives in host memory, by the settings that put it there, or that none of
    them is on (said if Ray kills a rank for host memory, runtime/lost_workers.py, and when the
    driver sees a phase near Ray's kill share)."""
    zero = run.deepspeed.get("zero_optimization", {})
    offload, params = zero.get("offload_optimizer") or {}, zero.get("offload_param") or {}
    trainer, rollout = run.flexrl.trainer, run.flexrl.rollout
    parts = []
    if offload.get("device") == "cpu":
        parts.append("the offloaded optimizer (zero_optimization.offload_optimizer: ratio "
                     f"{offload.get('ratio', 1.0)}, pin_memory {str(offload.get('pin_memory', False)).lower()}; "
                     "a lower ratio keeps less of it there)")
    if params.get("device") == "cpu":
        parts.append("the policy's and the reference's parameters (zero_optimization.offload_param)")
    if trainer.reference_offload_param:
        parts.append("the reference model's parameters (flexrl.trainer.reference_offload_param)")
    if trainer.colocate and trainer.offload_states_in_rollout:
        parts.append("the policy's states while its engine generates (flexrl.trainer.offload_states_in_rollout)")
    options = rollout.options
    if trainer.colocate and options.sleep_level == 1:
        parts.append(f"the engine's weights while it sleeps (flexrl.rollout.{rollout.backend}.sleep_level 1)")
    if not parts:
        settings = "ZeRO-3 offload_optimizer / offload_param, flexrl.trainer.reference_offload_param"
        if trainer.colocate:  # the other two act only on an engine inside the rank
            settings += f", offload_states_in_rollout, flexrl.rollout.{rollout.backend}.sleep_level 1"
        return f"None of the run's settings that put a policy rank's states in host memory is on ({settings})"
    return f"A policy rank's host memory holds {', '.join(parts)}; docs/BENCHMARKS.md has measured sizes"


def ray_cpus(run: Any, num_ranks: int) -> int:
    trainer, rollout, pool = run.flexrl.trainer, run.flexrl.rollout, run.flexrl.data.pool
    cpus = num_ranks * trainer.num_cpus_per_rank + pool.cpus_per_node
    if not trainer.colocate:
        cpus += rollout.num_engines * rollout.num_cpus_per_engine
    return int(cpus) + 2


def train_with_ray(run: Any, args: TrainArgs, raw_config: dict) -> int:
    prepared = prepare(run, args)
    if nothing_to_do(prepared):
        return 0
    clock = time.perf_counter()
    started = connect_ray(ray_cpus(run, prepared.num_ranks))
    clock = _progress(f"Ray {'started' if started else 'joined'}", clock)
    restarts, budget = 0, RestartBudget(run.flexrl.trainer.max_restarts)  # shared with engines recreated in place
    try:
        while True:
            try:
                return _run_groups(run, prepared, raw_config, clock, restarts, budget)
            except Exception as error:
                if not is_lost_worker(error) or not budget.take():
                    raise
                restarts += 1
                logger.info(f"flexrl train: {str(error).splitlines()[0]}\nflexrl train: restart {budget.used} of "
                            f"{budget.allowed} (flexrl.trainer.max_restarts): every worker rebuilt, from the last "
                            "checkpoint")
                checkpoint, start = resume_point(dataclasses.replace(args, resume=True))
                prepared = dataclasses.replace(prepared, checkpoint=checkpoint, start_step=start)
                clock = time.perf_counter()
    finally:
        if started:
            ray.shutdown()


def _run_groups(run: Any, prepared: Prepared, raw_config: dict, clock: float, restarts: int,
                budget: RestartBudget) -> int:
    """Build the data controller, the policy group and the rollout engines, drive the run, shut them down;
    `budget`: the restarts left, which separate engines lost in a step may take (trainer/rollout_group.py)."""
    trainer, rollout_config, args = run.flexrl.trainer, run.flexrl.rollout, prepared.args
    controller = policy = None
    rollout: ColocatedRollout | SeparateRollout | None = None
    try:
        controller = DataController(prepared.records, prepared.data_config, trainer.timeout_s)
        clock = _progress(f"data loader ready over {len(prepared.records)} records", clock)
        setup = policy_setup(run, args.model_dir, controller.pixels, colocated=trainer.colocate)
        policy = RayWorkerGroup(PolicyWorker, prepared.num_ranks, {"setup": setup}, trainer.num_cpus_per_rank,
                                trainer.num_gpus_per_rank, name="policy", timeout_s=trainer.timeout_s,
                                env=worker_env(), memory_hint=policy_memory_hint(run),
                                collective_timeout_s=trainer.group_timeout_s)
        clock = _progress(f"{policy_ranks(prepared.num_ranks)} ready (models loaded, DeepSpeed engines built"
                          f"{', rollout engines inside' if trainer.colocate else ''})", clock)
        if trainer.colocate:
            rollout = ColocatedRollout(policy)
        else:
            rollout = SeparateRollout(rollout_config.num_engines, rollout_config.backend, args.model_dir,
                                      controller.pixels, setup.dtype, rollout_config.num_cpus_per_engine,
                                      rollout_config.num_gpus_per_engine, rollout_config.max_batch_sequences,
                                      trainer.timeout_s, rollout_config.engine_options(colocated=False),
                                      gpus_per_policy_rank=trainer.num_gpus_per_rank, env=worker_env(),
                                      restart_budget=budget)
        return drive(prepared, controller, policy, rollout, raw_config, restarts)
    finally:
        for part in (rollout, policy, controller):
            if part is not None:
                _quietly(part.shutdown if hasattr(part, "shutdown") else part.close)


WORKER_ENV_KEYS = ("DS_ACCELERATOR", "OMP_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "FLEXRL_DEBUG",
                   "FLEXRL_LOG_LEVEL", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
WORKER_ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "VLLM_")
"""The driver's settings that policy ranks and rollout engines get as theirs: on a Ray cluster started
elsewhere they would otherwise run with the cluster's (NCCL's must match at both ends of a group)."""
WORKER_ENV_NODE_LOCAL = ("VLLM_HOST_IP", "VLLM_PORT", "VLLM_DP_")
"""...except what names the driver's own node or a vLLM data-parallel place: wrong on other nodes."""


def worker_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The part of `environ` (default: this process's) the driver's actors get (WORKER_ENV_*)."""
    environ = dict(os.environ if environ is None else environ)
    return {key: value for key, value in environ.items()
            if (key in WORKER_ENV_KEYS or key.startswith(WORKER_ENV_PREFIXES))
            and not key.startswith(WORKER_ENV_NODE_LOCAL)}


def _quietly(function) -> None:
    try:
        function()
    except Exception as error:  # shutdown after a failure: report, keep the original error
        logger.warning(f"flexrl train: shutdown step failed: {error}")


SPMD_NOTHING_TO_DO = "nothing to do"
"""What rank 0 tells the other ranks when --resume finds the run already complete."""


def train_spmd(run: Any, args: TrainArgs, raw_config: dict) -> int:
    """Every process of a launcher (deepspeed --hostfile, torchrun) runs this; rank 0 drives."""
    context = init_distributed(timeout_s=run.flexrl.trainer.group_timeout_s,
                               rendezvous_timeout_s=run.flexrl.trainer.timeout_s)
    rank, world = context.launch.rank, context.launch.world_size
    shared: list[Any] = [None]
    driver: tuple | None = None
    if rank == 0:
        shared[0], driver = _spmd_driver_start(run, args, world)
    dist.broadcast_object_list(shared, src=0)
    if isinstance(shared[0], Exception):
        if rank == 0:
            raise shared[0]
        return 2
    if shared[0] == SPMD_NOTHING_TO_DO:
        return 0
    address, pixels, run.flexrl.rollout, run.flexrl.rl, run.deepspeed = shared[0]
    if rank != 0:
        ray.init(address=address, namespace=pixels.namespace, log_to_driver=False, configure_logging=False)
    place = WorkerPlace(rank, world, context.launch.master_addr, context.launch.master_port, context.launch.local_rank,
                        ranks_on_node=context.launch.local_world_size)
    group = SPMDWorkerGroup(PolicyWorker(place, policy_setup(run, args.model_dir, pixels, colocated=True)), rank, world)
    # the launcher's SIGTERM after a rank failed: this rank's line first, with the checkpoint to resume from
    group.name_losses_when_stopped(lambda: str(latest_checkpoint(Path(args.out_dir)) or ""))
    dist.barrier()  # every rank has built its models, engines and rollout engine
    if rank != 0:
        group.serve()
        return 0
    prepared, controller, clock = driver
    _progress(f"{policy_ranks(world)} ready (models loaded, DeepSpeed engines built, rollout engines inside)", clock)
    try:
        return drive(prepared, controller, group, ColocatedRollout(group), raw_config)
    except LostRanks as error:  # said before the clean-up, which the launcher's SIGTERM may cut short
        logger.error(f"flexrl train: {error}")
        return 1
    finally:
        group.shutdown()
        controller.close()


def _spmd_driver_start(run: Any, args: TrainArgs, world: int) -> tuple[Any, tuple | None]:
    """Rank 0 of an SPMD run: the checks, Ray and the data controller, with progress lines. Returns
    (what the other ranks are told, what rank 0 keeps). Told: (GCS address, pixel source, and as
    prepare resolved them: the rollout section (media limits from the data), the rl section (defaults
    from other sections) and the DeepSpeed config (the schedule's length)), SPMD_NOTHING_TO_DO, or the exception
    that stops the run. Kept: (prepared, controller, clock) when the run goes on."""
    try:
        prepared = prepare(run, args, num_ranks=world)
        if nothing_to_do(prepared):
            return SPMD_NOTHING_TO_DO, None
        clock = time.perf_counter()
        started = connect_ray(ray_cpus(run, 0))
        clock = _progress(f"Ray {'started' if started else 'joined'}", clock)
        controller = DataController(prepared.records, prepared.data_config, run.flexrl.trainer.timeout_s)
        clock = _progress(f"data loader ready over {len(prepared.records)} records", clock)
        told = (ray.get_runtime_context().gcs_address, controller.pixels, run.flexrl.rollout, run.flexrl.rl,
                run.deepspeed)
        return told, (prepared, controller, clock)
    except Exception as error:
        return error, None
