"""Device memory of a training run per phase, estimated before any worker starts. Pure.

`estimate_memory(inputs)` adds up, for one policy rank's device, what each phase of a step holds:

- ZeRO-3 states, each partitioned over the `ranks` policy ranks: the parameters in the training dtype,
  their gradient partitions (fp32 with bf16/fp16 training: DeepSpeed keeps the partitions it averages
  into the optimizer's dtype), the fp32 master weights (mixed precision) and Adam's two moments; the
  share `offload_optimizer.ratio` of the last three lives in host memory instead; `offload_param`
  takes the parameters off the device;
- persistent parameters (`stage3_param_persistence_threshold`: `persistent_elements`), kept whole on
  every rank (the policy's, and the reference's, which the same JSON configures): beyond their
  partition, the other ranks' shares; with `offload_param` the whole of them on the device (their
  partition stays there too, past one rank). On one rank without `offload_param` nothing: there
  ZeRO-3's "gather" is a view of the partition;
- ZeRO-3's working set: the parameters gathered at a time (the largest one, the prefetch bucket and
  what `stage3_max_reuse_distance` keeps gathered) and, in the update, the gradient bucket
  (`reduce_bucket_size`) and the step's fp32 gradients of one `sub_group_size`;
- the reference model's parameters (`flexrl.rl.init_kl_coef` > 0) unless they live in host memory
  (`flexrl.trainer.reference_offload_param`);
- a colocated engine: awake in the rollout (vLLM: `gpu_memory_utilization` of the device; hf: the
  weights and the KV cache of the step's sequences), a residue asleep, its weights in the sync;
  what of the policy stays on the device while it generates follows `RolloutOffload`
  (models/zero3.py): everything moves under DeepSpeed's FusedAdam, the parameters and gradients under
  another optimizer on the device (torch's AdamW keeps the fp32 states there), the parameters with
  the optimizer offloaded (the device share of the optimizer and the gradients stays);
- activations at the planned token budget per rank (`flexrl.sp.max_tokens_per_rank`, else the
  step's samples per rank at the longest response plus the prompt tokens given): per token and
  decoder layer, `ACTIVATION_UNITS_PER_LAYER` hidden-sized and 4 MLP-sized tensors in the training
  dtype; with activation checkpointing, one hidden state per layer plus one layer's full set; the no-grad
  log-prob passes hold one layer's intermediates;
- the vision tower's activations in the update: its patch rows (merged vision tokens × merge²) × its
  blocks, counted as a decoder layer's are (checkpointed or not), and the pixels, for the vision tokens the caller
  counts (trainer/memory_check.py: every prompt token, an upper bound);
- the log-prob chunk (`flexrl.sp.logprob_chunk_bytes`, models/logprob_chunks.py) and a fixed
  `CONTEXT_BYTES` (the CUDA context, NCCL, the allocator's slack).

A phase over the device's memory is refused by the caller (trainer/memory_check.py) with the settings
that would take the most off that phase (`MemoryEstimate.advice`). The figures are estimates:
fragmentation is not modelled (`CONTEXT_BYTES` covers some of it).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

GIB = 2**30
CONTEXT_BYTES = 1 * GIB
"""Per device: the CUDA context, NCCL's buffers and the allocator's slack."""
ENGINE_ASLEEP_BYTES = 1 * GIB
"""A colocated engine's residue while asleep (its CUDA context and graphs)."""
ACTIVATION_UNITS_PER_LAYER = 12
"""Hidden-sized tensors a decoder layer keeps per token for its backward (two norms' inputs and
outputs, the projections' inputs, rotary q/k, attention q/out, the MLP's input), besides 4 of MLP size
(gate, up, activation, product) and 4 of KV size."""
PHASES = ("rollout", "logprobs", "update", "sync")
UNCERTAINTY = 0.03
"""The share of the device by which an estimate may be off (vLLM's pool, fragmentation): a phase
over the device by less than this is `MemoryEstimate.uncertain`, not refused."""


@dataclass(frozen=True)
class MemoryInputs:
    """What the estimate reads of the model, the DeepSpeed JSON and the `flexrl` section."""

    params: int
    """Trainable parameters of the model (all of them: language model and vision tower)."""
    hidden: int
    layers: int
    intermediate: int
    kv_dim: int
    """KV heads × head_dim."""
    largest_param: int
    """Elements of the largest parameter (the LM head or embedding: vocabulary × hidden)."""
    device_bytes: int
    ranks: int = 1
    """Policy ranks ZeRO-3 partitions over."""
    dtype_bytes: int = 2
    grad_bytes: int = 4
    master_weights: bool = True
    """An fp32 copy of the weights beside the bf16/fp16 ones (mixed precision)."""
    optimizer_offload_ratio: float = 0.0
    """Share of the optimizer (master weights, moments, gradients) in host memory (0: none)."""
    param_sizes: tuple[int, ...] = ()
    """Every parameter's elements in the model's order (DeepSpeed's sub-groups follow it); empty: unknown."""
    optimizer_offload_pinned: bool = False
    """`offload_optimizer.pin_memory`: DeepSpeed's gradient buffers in page-locked memory from torch's
    pinned allocator, which rounds each block up to a power of two (torch 2.11: 300 MiB asked, 512 held)."""
    param_offload: bool = False
    fused_adam: bool = False
    """DeepSpeed's FusedAdam on the device (every state can leave it during the rollout)."""
    persistent_elements: int = 0
    """Elements of the parameters ZeRO-3 keeps whole on every rank (`stage3_param_persistence_threshold`)."""
    prefetch_elements: int = 50_000_000
    reuse_elements: int = 1_000_000_000
    reduce_bucket_elements: int = 500_000_000
    sub_group_elements: int = 1_000_000_000
    reference: bool = True
    reference_offload: bool = False
    engine: str | None = "vllm"
    """The colocated engine's backend; None: engines elsewhere (no rollout phase on this device)."""
    gpu_memory_utilization: float = 0.35
    engine_kv_tokens: int = 0
    """hf engine: tokens of the sequences it holds a KV cache for at once."""
    offload_states_in_rollout: bool = True
    update_tokens: int = 0
    """Tokens one rank holds in one update micro-batch."""
    logprob_tokens: int = 0
    checkpointing: bool = False
    logprob_chunk_bytes: int = GIB
    sync_bucket_bytes: int = 512 * 2**20
    engine_sleep_level: int = 2
    """1: the colocated engine's weights wait in host memory while it sleeps; 2: freed."""
    vision_hidden: int = 0
    """The vision tower's width (0: no tower)."""
    vision_layers: int = 0
    vision_intermediate: int = 0
    vision_merge: int = 2
    """Patches merged into one vision token per side (spatial_merge_size)."""
    vision_patch_dim: int = 0
    """Values of one patch row of the pixels (channels × temporal patch × patch²): the tower's input,
    which its patch embedding keeps for backward."""
    update_vision_tokens: int = 0
    """Merged vision tokens one rank holds in one update micro-batch."""


@dataclass
class MemoryEstimate:
    """Bytes per phase, as named terms; `device_bytes` the device's memory."""

    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    device_bytes: int = 0
    inputs: MemoryInputs | None = None

    def total(self, phase: str) -> int:
        return sum(self.phases[phase].values())

    def peak_phase(self) -> str:
        return max(self.phases, key=self.total)

    def fits(self) -> bool:
        return all(self.total(phase) <= self.device_bytes for phase in self.phases)

    def refused(self) -> bool:
        """Over the device by more than the estimate's `UNCERTAINTY`: the run will not fit."""
        return any(self.total(phase) > self.device_bytes * (1 + UNCERTAINTY) for phase in self.phases)

    def over(self) -> list[str]:
        """The phases over the device's memory, worst first."""
        return sorted((p for p in self.phases if self.total(p) > self.device_bytes), key=self.total, reverse=True)

    def advice(self, phase: str) -> list[str]:
        """The settings that would take the most off `phase`, largest first (`phase_advice`)."""
        return phase_advice(self, phase)

    def format(self) -> str:
        """A table: each term per phase in GiB, the totals against the device; the host's share."""
        names = list(dict.fromkeys(term for terms in self.phases.values() for term in terms))
        phases = list(self.phases)
        lines = [f"{'GiB':<28}" + "".join(f"{phase:>10}" for phase in phases)]
        for name in names:
            lines.append(f"{name:<28}" + "".join(
                f"{self.phases[p][name] / GIB:>10.1f}" if name in self.phases[p] else f"{'':>10}" for p in phases))
        lines.append(f"{'total':<28}" + "".join(f"{self.total(p) / GIB:>10.1f}" for p in phases))
        near = "" if self.refused() else f", by less than {UNCERTAINTY:.0%}: may fit"
        verdict = "fits" if self.fits() else f"over in {', '.join(self.over())}{near}"
        lines.append(f"device: {self.device_bytes / GIB:.1f} GiB; {verdict}")
        if self.inputs is not None:
            host = host_memory(self.inputs)
            lines.append(f"host memory, one rank's share: ~{sum(host.values()) / GIB:.0f} GiB ("
                         + ", ".join(f"{name} {value / GIB:.1f}" for name, value in host.items()) + ")")
        return "\n".join(lines)


def policy_states(i: MemoryInputs) -> dict[str, int]:
    """The policy's ZeRO-3 partitions on this device."""
    kept = 1.0 - i.optimizer_offload_ratio
    optimizer_bytes = (4 if i.master_weights else 0) + 8
    return {"policy parameters": 0 if i.param_offload else i.params * i.dtype_bytes // i.ranks,
            "policy gradients": int(i.params * i.grad_bytes * kept) // i.ranks,
            "optimizer states": int(i.params * optimizer_bytes * kept) // i.ranks}


def states_kept_in_rollout(i: MemoryInputs, states: dict[str, int]) -> dict[str, int]:
    """What of the policy's states stays on the device while a colocated engine generates."""
    if not i.offload_states_in_rollout:
        return states
    if i.optimizer_offload_ratio > 0:  # the parameters move; the optimizer's device share stays
        return {name: value for name, value in states.items() if name != "policy parameters"}
    if i.fused_adam:
        return {}
    # torch's AdamW: DeepSpeed moves the parameters and their bf16 gradients, not the fp32 states
    # (master weights, moments, the fp32 gradient partitions: 99.0 GiB measured in a 3B rollout on
    # one H200 at gpu_memory_utilization 0.3, against 98 GiB estimated; docs/BENCHMARKS.md, "Memory
    # settings and what each costs")
    return {name: states[name] for name in ("optimizer states", "policy gradients")}


def persistent_bytes(i: MemoryInputs, offloaded: bool) -> int:
    """One engine's persistent parameters beyond what its partitions count on this device: whole on
    every rank; `offloaded` (`offload_param`: the partitions in host memory) those stay on the device."""
    whole = i.persistent_elements * i.dtype_bytes
    if offloaded:
        return whole + (whole // i.ranks if i.ranks > 1 else 0)
    return whole - whole // i.ranks


def gathered_bytes(i: MemoryInputs) -> int:
    """ZeRO-3's gathered parameters at a time (also on one rank: a local copy)."""
    return min(i.params, i.largest_param + i.prefetch_elements + i.reuse_elements) * i.dtype_bytes


def activation_bytes(i: MemoryInputs) -> int:
    """The update micro-batch's saved activations (decoder layers)."""
    per_layer = i.dtype_bytes * (ACTIVATION_UNITS_PER_LAYER * i.hidden + 4 * i.intermediate + 4 * i.kv_dim)
    if i.checkpointing:
        per_token = i.layers * i.hidden * i.dtype_bytes + per_layer
    else:
        per_token = i.layers * per_layer
    return per_token * i.update_tokens


def vision_activation_bytes(i: MemoryInputs) -> int:
    """The vision tower's saved activations for the update micro-batch's patch rows: its input pixels
    and its blocks' tensors."""
    per_layer = i.dtype_bytes * (ACTIVATION_UNITS_PER_LAYER * i.vision_hidden + 4 * i.vision_intermediate)
    per_row = (i.vision_layers * i.vision_hidden * i.dtype_bytes + per_layer) if i.checkpointing \
        else i.vision_layers * per_layer
    per_row += i.vision_patch_dim * i.dtype_bytes
    return per_row * i.update_vision_tokens * i.vision_merge ** 2


def logprob_pass_bytes(i: MemoryInputs) -> int:
    """A no-grad pass: one layer's intermediates and the residual stream."""
    return i.dtype_bytes * (6 * i.hidden + 3 * i.intermediate) * i.logprob_tokens


def engine_awake_bytes(i: MemoryInputs) -> int:
    if i.engine == "vllm":
        return int(i.gpu_memory_utilization * i.device_bytes)
    kv = i.engine_kv_tokens * i.layers * 2 * i.kv_dim * i.dtype_bytes
    return i.params * i.dtype_bytes + kv


def estimate_memory(i: MemoryInputs) -> MemoryEstimate:
    """Every phase's terms on one policy rank's device."""
    states = policy_states(i)
    reference = {"reference parameters": i.params * i.dtype_bytes // i.ranks
                 if i.reference and not i.reference_offload else 0}
    fixed = {"context": CONTEXT_BYTES}
    asleep = {"engine asleep": ENGINE_ASLEEP_BYTES} if i.engine else {}
    gathered = {"zero3 gathered": gathered_bytes(i)}
    if i.persistent_elements:
        gathered["zero3 persistent"] = (persistent_bytes(i, i.param_offload) + (
            persistent_bytes(i, i.reference_offload) if i.reference else 0))
    chunk = {"logprob chunk": i.logprob_chunk_bytes}
    phases: dict[str, dict[str, int]] = {}
    if i.engine:
        phases["rollout"] = {**states_kept_in_rollout(i, states), **reference,
                             "engine awake": engine_awake_bytes(i), **fixed}
    phases["logprobs"] = {**states, **reference, **asleep, **gathered, **chunk,
                          "activations": logprob_pass_bytes(i), **fixed}
    kept = 1.0 - i.optimizer_offload_ratio
    step_grads = int(min(i.sub_group_elements, i.params // i.ranks) * 4 * kept)
    phases["update"] = {**states, **reference, **asleep, **gathered,
                        "gradient bucket": i.reduce_bucket_elements * i.dtype_bytes,
                        "activations": max(activation_bytes(i) + i.logprob_chunk_bytes, step_grads),
                        **({"vision activations": vision_activation_bytes(i)} if i.vision_layers else {}), **fixed}
    if i.engine:
        phases["sync"] = {**states, **reference, "engine weights": i.params * i.dtype_bytes,
                          "sync bucket": i.sync_bucket_bytes, **gathered, **fixed}
    return MemoryEstimate(phases, i.device_bytes, i)


HOST_BASE_BYTES = 11 * GIB
"""Host memory of a one-GPU run besides the terms `host_memory` counts (Ray, the driver, the data
actors, the processes' own). Measured against counted with it (H100 80GB, 2026-12-05/06, and H200),
the optimizer offloaded and pinned: 60 %, 97.8 against 98 GiB (5.03 B parameters), 97.2 against 99
(5.29 B); 30 %, 45-46 against 47 (4.07 B); on the H200, states kept on the device in the rollout: 60 %,
101 against 105 (7.2 B, the tiny vocabulary); 40 %, 107 against 106 (Qwen3-VL-8B, 8.77 B)."""


def pinned_block(size: int) -> int:
    """What torch's pinned allocator holds for a block of `size` bytes: the next power of two."""
    return 1 << (size - 1).bit_length() if size > 0 else 0


def host_memory(i: MemoryInputs) -> dict[str, int]:
    """What the run keeps in the node's host memory, per policy rank's share, besides `HOST_BASE_BYTES`:
    DeepSpeed's offloaded optimizer: one flat gradient buffer for every parameter in the training
    dtype, the offloaded parameters' fp32 gradients in one buffer per sub-group (`sub_group_size`), each
    pinned block rounded up to a power of two (`pinned_block`), and their fp32 master weights and
    moments (12 B each, pageable); the reference's parameters when offloaded (~3.5 B each measured: 25
    GiB at 7.1B parameters); the policy's states moved out for the rollout (one pinned block unless
    FusedAdam moves every state); and a sleeping engine's weights at `sleep_level` 1. Informative: not
    checked."""
    terms = {"base": HOST_BASE_BYTES}
    if i.optimizer_offload_ratio > 0:
        terms["gradient buffers"] = _offloaded_gradient_bytes(i)
        terms["offloaded optimizer"] = int(i.params * 12 * i.optimizer_offload_ratio) // i.ranks
    if i.reference and i.reference_offload:
        terms["reference parameters"] = int(i.params * 3.5) // i.ranks
    if i.engine:
        states = policy_states(i)
        moved = sum(states.values()) - sum(states_kept_in_rollout(i, states).values())
        terms["states moved for the rollout"] = moved if i.fused_adam else pinned_block(moved)
        if i.engine_sleep_level == 1:
            terms["engine weights asleep"] = i.params * i.dtype_bytes
    return terms


def _offloaded_gradient_bytes(i: MemoryInputs) -> int:
    """The offloaded optimizer's gradient buffers on the host: the flat buffer of every parameter's
    gradient (the training dtype) and the fp32 gradients of the offloaded sub-groups, as torch's
    pinned allocator holds them when `offload_optimizer.pin_memory` is on. With the parameters' sizes
    known, the sub-groups are DeepSpeed's own (`offloaded_sub_groups`); else ones of `sub_group_size`."""
    flat = i.params * i.dtype_bytes // i.ranks
    offloaded = int(i.params * i.optimizer_offload_ratio) // i.ranks
    if not i.optimizer_offload_pinned:
        return flat + 4 * offloaded
    if i.param_sizes:
        groups = offloaded_sub_groups(i.param_sizes, i.ranks, i.sub_group_elements, i.optimizer_offload_ratio)
        return pinned_block(flat) + sum(pinned_block(4 * elements) for elements in groups)
    count = -(-offloaded // i.sub_group_elements)
    return pinned_block(flat) + count * pinned_block(4 * min(i.sub_group_elements, offloaded))


def offloaded_sub_groups(param_sizes: tuple[int, ...], ranks: int, sub_group_elements: int,
                         ratio: float) -> list[int]:
    """Elements of each sub-group DeepSpeed 0.19's ZeRO-3 steps on the host: one rank's partitions of
    the parameters, in order, closed into a sub-group once it holds `sub_group_elements` (so a
    sub-group can hold more, and one large parameter is a sub-group alone); of n sub-groups, those
    from index int((1 - ratio) * n) on are offloaded (`offload_optimizer.ratio`)."""
    groups, current = [], 0
    for size in param_sizes:
        current += -(-size // ranks)
        if current >= sub_group_elements:
            groups.append(current)
            current = 0
    if current:
        groups.append(current)
    return groups[int((1 - ratio) * len(groups)):]


def phase_advice(estimate: MemoryEstimate, phase: str) -> list[str]:
    """Settings that would take memory off `phase`, each with what it would save, largest first."""
    i, terms = estimate.inputs, estimate.phases[phase]
    assert i is not None
    over = estimate.total(phase) - estimate.device_bytes
    options: list[tuple[int, str]] = []
    if phase == "rollout" and not i.offload_states_in_rollout:
        saved = sum(terms[k] for k in ("policy parameters", "policy gradients", "optimizer states") if k in terms) \
            - sum(states_kept_in_rollout(_replace(i, offload_states_in_rollout=True), policy_states(i)).values())
        options.append((saved, "flexrl.trainer.offload_states_in_rollout: true"))
    if phase == "rollout" and i.engine == "vllm":
        room = estimate.device_bytes - (estimate.total(phase) - terms["engine awake"])
        fraction = room / estimate.device_bytes - 0.01
        weights = i.params * i.dtype_bytes / estimate.device_bytes
        if fraction > weights + 0.02:  # the engine needs its weights and some KV cache
            options.append((terms["engine awake"] - int(fraction * estimate.device_bytes),
                            f"flexrl.rollout.vllm.gpu_memory_utilization: at most {fraction:.2f}"))
    if terms.get("reference parameters"):
        options.append((terms["reference parameters"], "flexrl.trainer.reference_offload_param: true"))
    if phase in ("update", "logprobs", "sync") and i.optimizer_offload_ratio < 1.0:
        options.append(offload_advice(i, terms, over))
    if phase == "update":
        options += activation_advice(i, over)
    return [f"{text} (saves ~{saved / GIB:.1f} GiB)" for saved, text in sorted(options, reverse=True) if saved > 0]


def offload_advice(i: MemoryInputs, terms: dict[str, int], over: int) -> tuple[int, str]:
    """The optimizer's offload ratio that takes `over` bytes off (rounded up to 0.05, at most 1)."""
    on_device = terms["optimizer states"] + terms["policy gradients"]
    whole = on_device / (1.0 - i.optimizer_offload_ratio)  # what ratio 0 would keep on the device
    ratio = min(1.0, -(-(i.optimizer_offload_ratio + max(over, 0) / whole) * 20 // 1) / 20)
    moved = whole * (ratio - i.optimizer_offload_ratio)
    return (int(moved), f"zero_optimization.offload_optimizer: device cpu, ratio {ratio:.2f} "
                        f"(~{moved / GIB:.0f} GiB more host memory)")


def activation_advice(i: MemoryInputs, over: int) -> list[tuple[int, str]]:
    """Checkpointing and a smaller token cap, with what each would save."""
    options = []
    now = activation_bytes(i)
    if not i.checkpointing:
        options.append((now - activation_bytes(_replace(i, checkpointing=True)),
                        "flexrl.trainer.activation_checkpointing: true"))
    if i.update_tokens > 0 and now > 0:
        per_token = now / i.update_tokens
        cap = int((now - max(over, 0)) / per_token) // 256 * 256
        if 256 <= cap < i.update_tokens:  # a cap that alone makes the phase fit
            options.append((int((i.update_tokens - cap) * per_token), f"flexrl.sp.max_tokens_per_rank: {cap}"))
    return options


def _replace(inputs: MemoryInputs, **changes) -> MemoryInputs:
    return replace(inputs, **changes)
