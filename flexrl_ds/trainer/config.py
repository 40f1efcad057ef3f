"""Trainer settings (section `flexrl.trainer` of a run config)."""

from __future__ import annotations

from dataclasses import dataclass

VISION_ATTENTION = ("varlen", "sdpa")
MEMORY_CHECKS = ("refuse", "warn", "off")


@dataclass
class TrainerConfig:
    """Where the GRPO workers run and what the run keeps (section `flexrl.trainer`)."""

    num_policy_ranks: int = 2
    """Policy (and reference) ranks: one DeepSpeed ZeRO-3 engine each; the FlexUlysses world size.
    Ignored under `flexrl train --spmd`: there every launched process is a rank."""
    seed: int = 0
    """Seed of the run: model init of nothing (weights come from --model), sampling per (step, prompt,
    sample), and every other random choice."""
    max_steps: int = 1
    """GRPO steps to run (the CLI's --max-steps overrides)."""
    save_every: int = 0
    """Write a checkpoint and an HF export every N steps; 0: none on a schedule (only the one after
    the last step, when `save_last` is true)."""
    save_last: bool = True
    """Also write one after the last step (false: a measurement run, e.g. a 7B policy whose
    optimizer states would take ~100 GB of disk)."""
    save_rollouts: bool = False
    """Write rollouts/step_N.jsonl (ids, tokens, text, reward, advantage per sample)."""
    colocate: bool = True
    """True: one rollout engine inside each policy rank, on the rank's device, asleep while the
    policy trains. The reference model is not moved; on GPUs the policy's ZeRO-3 states go to host
    memory during the rollout only with `offload_states_in_rollout`. False: `flexrl.rollout.num_engines`
    engines in Ray actors of their own, with the CPUs and GPUs `flexrl.rollout.num_*_per_engine`
    reserve (a fraction of a GPU may share one with a policy rank). Ignored under `flexrl train
    --spmd`, where the engines are always inside the ranks."""
    num_cpus_per_rank: float = 1.0
    """Ray CPUs reserved per policy rank (fractions allowed)."""
    num_gpus_per_rank: float = 0.0
    """Ray GPUs per policy rank (0 on CPU machines)."""
    host_threads_per_rank: int = 0
    """OpenMP and torch threads of each policy rank's host work: DeepSpeed's CPUAdam over an offloaded
    optimizer share, ZeRO-3 offload's gradient copies and norms (runtime/host_threads.py). 0: the
    node's cores less the data-loading actors' CPUs, over its policy ranks (a Ray actor would otherwise
    take one thread per CPU it reserves). Set it under a launcher that binds each rank to its own cores."""
    activation_checkpointing: bool = False
    """Recompute each decoder and vision layer in the backward pass (transformers' gradient
    checkpointing, non-reentrant) instead of keeping its activations: one layer's activations live
    at a time, for about a third more compute in the update (long sequences, big models)."""
    zero3_leaf_layers: bool = True
    """Every decoder layer and vision block a ZeRO-3 leaf module (DeepSpeed `set_z3_leaf_modules`):
    its parameters fetched and released together by the layer's hooks, its submodules hookless, so a
    micro-batch makes ~20x fewer hook calls (docs/notes/zero3-one-rank-host-cost.md); one layer's
    parameters are gathered at once (a 3B decoder layer: 0.14 GiB in bf16, within what ZeRO-3's
    prefetch holds anyway). On an H100 it took a 3B update of 64 samples from 5.8 to 4.4 s
    (docs/BENCHMARKS.md, "Real shapes"). False: every module's own hooks (DeepSpeed's default)."""
    vision_attention: str = "varlen"
    """The vision tower's attention in the policy and reference passes: "varlen", one varlen kernel
    call per layer over all of a rank's windows (models/hf_adapter.py; SDPA per window on CPU), or
    "sdpa", transformers' own per-window SDPA calls (thousands a layer for a step of videos)."""
    offload_states_in_rollout: bool = True
    """Colocated engines on GPUs: while the engine generates, the policy's ZeRO-3 states that
    DeepSpeed can move wait in (pinned) host memory (models/zero3.py `RolloutOffload`): every state
    under DeepSpeed's FusedAdam; the parameters, their gradients and the gradient buckets under
    another optimizer on the device; the parameters and the buckets with the optimizer offloaded.
    False keeps them on the device: no copies to host memory and back around each rollout, at the
    price of that much device memory in use while the engine generates. Either way torch's cached
    blocks go back to the device before the engine wakes."""
    reference_offload_param: bool = False
    """The reference model's ZeRO-3 parameters live in pinned host memory and are fetched to the
    device module by module for each of its passes (DeepSpeed's `zero_optimization.offload_param`,
    set for the reference engine only): its parameters (2 bytes each in bf16) leave the device for the
    whole step, at the cost of one host-to-device copy of them per reference pass. For colocated runs
    short of device memory (OpenRLHF's `--ref_reward_offload`). Measured at 7B on one H200
    (docs/BENCHMARKS.md, "Memory settings and what each costs"): ~25 GiB more host memory (about
    twice the parameters' bytes, compared across leases) and log-prob passes 0-1.2 s slower a step;
    with the optimizer offloaded at ratio 0.6 the node's 125 GiB did not hold both, at 0.5 it did
    (112 GiB), without a faster step than 0.6 alone."""
    memory_check: str = "refuse"
    """Before any worker starts, the run's device memory per phase is estimated (trainer/memory_estimate.py;
    `flexrl estimate-memory` prints it): "refuse" stops a run whose estimate exceeds the device, naming
    the settings to change; "warn" says so and starts; "off" skips it. Only where there is a GPU, or
    `device_memory_gb` is set."""
    device_memory_gb: float | None = None
    """The device memory the estimate checks against, in GiB; None: the GPU's own."""
    weight_sync_bucket_mb: int = 512
    """ZeRO-3 parameters are gathered for the rollout engines in buckets of about this many MiB."""
    timeout_s: float = 900.0
    """The longest wait for one worker call, the longest a launcher's ranks wait for each other to
    join at start (the rendezvous), and the policy group's collective timeout unless
    `collective_timeout_s` is set."""
    collective_timeout_s: float | None = None
    """The longest a policy rank waits in one collective (torch.distributed's process-group timeout,
    gloo and NCCL) before it fails: when a rank is killed or stalls, every other rank fails within
    this many seconds, the run stops naming the lost rank and the step, and --resume continues from
    the last checkpoint (runtime/rank_failures.py). Also the longest one rank may answer a driver's
    call after another did (plus 5 s), so that a rank stalled outside a collective is caught too.
    None: `timeout_s`. Long enough for the widest gap between ranks in any phase (a colocated
    rollout's longest generation against the shortest, a checkpoint save)."""
    max_restarts: int = 0
    """Times the driver may restart its workers in the same job after losing one (a policy rank or a
    rollout engine killed, crashed or stalled: runtime/rank_failures.py): every worker group is rebuilt
    and the run continues from the last complete checkpoint, as TorchElastic restarts a group; the
    steps after that checkpoint are run again (the same samples: resume is exact). Counted in the
    metrics (`num_restarts`). A separate rollout engine (`colocate` false) lost in a rollout or a
    sync takes one of these restarts too, but cheaper: the engines alone are recreated in place from
    the policy's current weights and the call retried (trainer/rollout_group.py; `num_engine_restarts`).
    0: a lost worker ends the run (--resume continues it). Ray path only; under a launcher its own
    restarts apply (torchrun --max-restarts)."""
    profile_step: int | None = None
    """A step (0-based) whose log-prob, update and sync phases every policy rank profiles with
    torch.profiler (parallel/profiling.py): OUT/profile/step_N_rank_R.txt, flexrl's regions (batch
    building with the pixel pulls, forward, loss, backward, optimizer step) and the ops with the most
    self time, and .json.gz, the trace for Perfetto; None: off."""
    tensorboard: bool = True
    """Also write the step metrics as TensorBoard scalars under OUT/tensorboard (when installed)."""
    wandb_project: str | None = None
    """Also log to this Weights & Biases project (when wandb is installed); None: off."""

    def __post_init__(self) -> None:
        if self.num_policy_ranks < 1:
            raise ValueError(f"flexrl.trainer.num_policy_ranks: must be at least 1, got {self.num_policy_ranks}")
        if self.max_steps < 1:
            raise ValueError(f"flexrl.trainer.max_steps: must be at least 1, got {self.max_steps}")
        if self.save_every < 0:
            raise ValueError(f"flexrl.trainer.save_every: must be >= 0, got {self.save_every}")
        if self.host_threads_per_rank < 0:
            raise ValueError("flexrl.trainer.host_threads_per_rank must be >= 0 (0: automatic), "
                             f"got {self.host_threads_per_rank}")
        if self.num_cpus_per_rank <= 0 or self.num_gpus_per_rank < 0:
            raise ValueError("flexrl.trainer.num_cpus_per_rank must be > 0 and num_gpus_per_rank >= 0")
        if self.max_restarts < 0:
            raise ValueError(f"flexrl.trainer.max_restarts: must be >= 0, got {self.max_restarts}")
        if self.weight_sync_bucket_mb < 1:
            raise ValueError("flexrl.trainer.weight_sync_bucket_mb: must be at least 1, got "
                             f"{self.weight_sync_bucket_mb}")
        if self.profile_step is not None and self.profile_step < 0:
            raise ValueError(f"flexrl.trainer.profile_step: must be >= 0, got {self.profile_step}")
        if self.vision_attention not in VISION_ATTENTION:
            raise ValueError(f"flexrl.trainer.vision_attention: one of {', '.join(VISION_ATTENTION)}, got "
                             f"{self.vision_attention!r}")
        if self.memory_check not in MEMORY_CHECKS:
            raise ValueError(f"flexrl.trainer.memory_check: one of {', '.join(MEMORY_CHECKS)}, "
                             f"got {self.memory_check!r}")
        if self.device_memory_gb is not None and self.device_memory_gb <= 0:
            raise ValueError(f"flexrl.trainer.device_memory_gb: must be positive, got {self.device_memory_gb}")
        if self.timeout_s <= 0:
            raise ValueError(f"flexrl.trainer.timeout_s: must be positive, got {self.timeout_s}")
        if self.collective_timeout_s is not None and not 0 < self.collective_timeout_s <= self.timeout_s:
            raise ValueError(f"flexrl.trainer.collective_timeout_s: must be positive and at most timeout_s "
                             f"({self.timeout_s}), got {self.collective_timeout_s}")

    @property
    def group_timeout_s(self) -> float:
        """The policy group's collective timeout: `collective_timeout_s`, else `timeout_s`."""
        return self.collective_timeout_s if self.collective_timeout_s is not None else self.timeout_s
