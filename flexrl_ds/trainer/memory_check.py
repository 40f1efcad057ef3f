"""The run's device memory estimate from its config and model directory, and the pre-start refusal.

`memory_inputs` reads what trainer/memory_estimate.py needs: the model's parameters (counted on
torch's meta device: no memory, no weights read), its decoder shape, the DeepSpeed JSON's ZeRO-3
settings and the `flexrl` section's batch, engine and token budget. `check_memory` runs before any
worker starts (trainer/launch.py `prepare`): a run whose estimate exceeds the device is refused with
one line naming the phase and the settings that would take the most off it
(`flexrl.trainer.memory_check`). `flexrl estimate-memory` prints the whole table.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from flexrl_ds.parallel import device as device_mod
from flexrl_ds.runtime import host_memory as node_memory
from flexrl_ds.trainer.memory_estimate import (GIB, UNCERTAINTY, MemoryEstimate, MemoryInputs, estimate_memory,
                                               host_memory)


def model_size(model_dir: str, persistence_threshold: int = 0,
               model_persistence_threshold: int = sys.maxsize) -> dict[str, int]:
    """Parameters (all, and the largest one's elements), decoder shape of the model in `model_dir`, and
    the elements ZeRO-3 keeps whole under those persistence thresholds (DeepSpeed's rule: parameters
    of at most `persistence_threshold` elements, in module order, while their sum stays within
    `model_persistence_threshold`)."""
    import torch
    import transformers

    # lazy: models/zero3.py imports torch, which the memory check's callers need not import to read it
    from flexrl_ds.models.zero3 import persistent_elements

    config = transformers.AutoConfig.from_pretrained(model_dir)
    architecture = (getattr(config, "architectures", None) or ["AutoModelForImageTextToText"])[0]
    model_class = getattr(transformers, architecture, None) or transformers.AutoModelForImageTextToText
    with torch.device("meta"):
        model = model_class._from_config(config) if hasattr(model_class, "_from_config") \
            else model_class.from_config(config)
    sizes = [parameter.numel() for parameter in model.parameters()]
    persistent = persistent_elements(model, persistence_threshold, model_persistence_threshold)
    text = config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    vision = getattr(config, "vision_config", None)
    tower = {} if vision is None else {
        "vision_hidden": int(vision.hidden_size), "vision_layers": int(vision.depth),
        "vision_intermediate": int(vision.intermediate_size), "vision_merge": int(vision.spatial_merge_size),
        "vision_patch_dim": int(vision.in_channels) * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2}
    return {"params": sum(sizes), "largest_param": max(sizes), "param_sizes": tuple(sizes),
            "persistent_elements": persistent,
            "hidden": int(text.hidden_size),
            "layers": int(text.num_hidden_layers), "intermediate": int(text.intermediate_size),
            "kv_dim": int(text.num_key_value_heads) * int(head_dim), **tower}


def zero3_inputs(ds_config: dict) -> dict[str, Any]:
    """The ZeRO-3, precision and optimizer settings the estimate reads."""
    zero = ds_config.get("zero_optimization", {})
    optimizer = zero.get("offload_optimizer") or {}
    offloaded = str(optimizer.get("device", "none")).lower() in ("cpu", "nvme")
    params = zero.get("offload_param") or {}
    mixed = bool(ds_config.get("bf16", {}).get("enabled") or ds_config.get("fp16", {}).get("enabled"))
    adam = ds_config.get("optimizer", {})
    fused = (str(adam.get("type", "")).lower() in ("adam", "adamw") and not offloaded
             and not adam.get("params", {}).get("torch_adam", False))
    return dict(dtype_bytes=2 if mixed else 4, master_weights=mixed,
                optimizer_offload_ratio=float(optimizer.get("ratio", 1.0)) if offloaded else 0.0,
                optimizer_offload_pinned=offloaded and bool(optimizer.get("pin_memory", False)),
                param_offload=str(params.get("device", "none")).lower() in ("cpu", "nvme"), fused_adam=fused,
                prefetch_elements=int(float(zero.get("stage3_prefetch_bucket_size", 5e7))),
                reuse_elements=int(float(zero.get("stage3_max_reuse_distance", 1e9))),
                reduce_bucket_elements=int(float(zero.get("reduce_bucket_size", 5e8))),
                sub_group_elements=int(float(zero.get("sub_group_size", 1e9))))


def token_budget(flexrl: Any, num_ranks: int, prompt_tokens: int) -> dict[str, int]:
    """Tokens per rank of one update micro-batch and of one log-prob pass: the step's samples at the
    longest response plus `prompt_tokens`, spread over the ranks, under the token caps."""
    loader, sp = flexrl.data.loader, flexrl.sp
    samples = loader.global_batch * loader.num_samples_per_prompt
    per_sample = prompt_tokens + flexrl.rollout.max_response_length
    update_samples = math.ceil(samples / flexrl.rl.mini_batches_per_step / num_ranks)
    update = update_samples * per_sample
    logprob = math.ceil(samples / num_ranks) * per_sample
    if sp.max_tokens_per_rank is not None:
        update = min(update, sp.max_tokens_per_rank)
        logprob = min(logprob, sp.logprob_max_tokens_per_rank or sp.max_tokens_per_rank)
    engine_sequences = min(flexrl.rollout.max_batch_sequences, math.ceil(samples / num_ranks))
    vision = min(update, update_samples * prompt_tokens)  # every prompt token a vision token: an upper bound
    return {"update_tokens": update, "logprob_tokens": logprob, "engine_kv_tokens": engine_sequences * per_sample,
            "update_vision_tokens": vision}


def memory_inputs(run: Any, model_dir: str, num_ranks: int, device_bytes: int, prompt_tokens: int = 0,
                  size: dict[str, int] | None = None, spmd: bool = False) -> MemoryInputs:
    """The estimate's inputs for this run on a device of `device_bytes` (`size`: `model_size`'s, if known)."""
    flexrl = run.flexrl
    trainer, rollout = flexrl.trainer, flexrl.rollout
    engine = rollout.backend if trainer.colocate or spmd else None  # --spmd: engines always in the ranks
    options = getattr(rollout, rollout.backend, None)
    zero = run.deepspeed.get("zero_optimization", {})
    sizes: dict[str, Any] = dict(size or model_size(
        model_dir, int(float(zero.get("stage3_param_persistence_threshold", 1e5))),
        int(float(zero.get("stage3_model_persistence_threshold", sys.maxsize)))))
    budget: dict[str, Any] = token_budget(flexrl, num_ranks, prompt_tokens)
    return MemoryInputs(
        **sizes, device_bytes=device_bytes, ranks=num_ranks, **zero3_inputs(run.deepspeed),
        reference=flexrl.rl.init_kl_coef > 0, reference_offload=trainer.reference_offload_param, engine=engine,
        gpu_memory_utilization=float(getattr(options, "gpu_memory_utilization", 0.0) or 0.0),
        engine_sleep_level=int(getattr(options, "sleep_level", 2)),
        offload_states_in_rollout=trainer.offload_states_in_rollout, checkpointing=trainer.activation_checkpointing,
        logprob_chunk_bytes=flexrl.sp.logprob_chunk_bytes, sync_bucket_bytes=trainer.weight_sync_bucket_mb * 2**20,
        **budget)


def refusal(estimate: MemoryEstimate, prompt_tokens: int) -> str:
    """One line: the worst phase over the device, its estimate and the settings to change."""
    phase = estimate.over()[0]
    inputs = estimate.inputs
    assert inputs is not None
    counted = "" if prompt_tokens else (", counting the responses at flexrl.rollout.max_response_length "
                                        "and no prompt tokens")
    tokens = f"{inputs.update_tokens} tokens per rank in an update micro-batch{counted}"
    advice = estimate.advice(phase)
    return (f"device memory: the {phase} phase needs ~{estimate.total(phase) / GIB:.1f} GiB of the device's "
            f"{estimate.device_bytes / GIB:.1f} GiB ({tokens}; `flexrl estimate-memory` shows every term). Change "
            + ("; or ".join(advice[:3]) if advice else "the batch or the model")
            + ". flexrl.trainer.memory_check: \"warn\" starts it anyway.")


def check_memory(run: Any, model_dir: str, num_ranks: int, spmd: bool = False) -> MemoryEstimate | None:
    """Refuse (ValueError) or warn about a run whose estimate exceeds the device (or, where this
    machine's GPU is the one checked, the node's host memory past Ray's kill share), per
    `flexrl.trainer.memory_check`; None where there is nothing to check against (no GPU here and no
    `flexrl.trainer.device_memory_gb`) or the check is off."""
    trainer = run.flexrl.trainer
    if trainer.memory_check == "off":
        return None
    device_bytes = int(trainer.device_memory_gb * GIB) if trainer.device_memory_gb else device_mod.device_memory_bytes()
    if device_bytes is None:
        return None
    estimate = estimate_memory(memory_inputs(run, model_dir, num_ranks, device_bytes, spmd=spmd))
    host_line, host_refused = host_verdict(estimate, max(1, min(num_ranks, device_mod.num_gpus())))
    # this machine's host memory is the ranks' only where its GPU is the one checked (no device_memory_gb)
    if host_line and host_refused and trainer.memory_check == "refuse" and not trainer.device_memory_gb:
        raise ValueError(f"{host_line}. flexrl.trainer.memory_check: \"warn\" starts it anyway.")
    if host_line:
        print(f"warning: {host_line}", flush=True)
    if not estimate.fits():
        line = refusal(estimate, 0)
        if trainer.memory_check == "refuse" and estimate.refused():
            raise ValueError(line)
        print(f"warning: {line}", flush=True)
    return estimate


def host_verdict(estimate: MemoryEstimate, ranks_per_node: int) -> tuple[str, bool]:
    """A line when the ranks of one node would fill its host memory past Ray's kill share ("" otherwise),
    and whether by more than the estimate's `UNCERTAINTY` (Ray would kill a rank: `check_memory`
    refuses the run)."""
    assert estimate.inputs is not None
    inputs = estimate.inputs
    shares = host_memory(inputs)
    total = sum(shares.values()) + (ranks_per_node - 1) * (sum(shares.values()) - shares["base"])
    limit = node_memory.ray_kill_share() * node_memory.bytes_total()
    if total <= limit:
        return "", False
    return (f"host memory: ~{total / GIB:.0f} GiB estimated for {ranks_per_node} rank(s) on this node, over Ray's kill "
            f"line at {limit / GIB:.0f} GiB ({', '.join(f'{k} {v / GIB:.0f}' for k, v in shares.items())} GiB a rank): "
            "a lower zero_optimization.offload_optimizer ratio, flexrl.trainer.offload_states_in_rollout false or "
            "flexrl.trainer.reference_offload_param false takes host memory off"), total > limit * (1 + UNCERTAINTY)


def estimate_run(run: Any, model_dir: str, ranks: int | None, device_memory_gb: float | None,
                 prompt_tokens: int) -> tuple[str, bool]:
    """`flexrl estimate-memory`: the table, the verdict and the advice per phase over the device;
    and whether the run fits."""
    gb = device_memory_gb or run.flexrl.trainer.device_memory_gb
    device_bytes = int(gb * GIB) if gb else device_mod.device_memory_bytes()
    if device_bytes is None:
        raise ValueError("--device-memory-gb: no GPU here, so give the device's memory (e.g. 79.6 for an H100 80GB)")
    if prompt_tokens < 0:
        raise ValueError(f"--prompt-tokens: must be >= 0, got {prompt_tokens}")
    num_ranks = ranks or run.flexrl.trainer.num_policy_ranks
    inputs = memory_inputs(run, model_dir, num_ranks, device_bytes, prompt_tokens)
    estimate = estimate_memory(inputs)
    lines = [f"{run.source}, {model_dir}: {inputs.params / 1e9:.2f}B parameters, {num_ranks} policy rank(s); tokens "
             f"per rank: update micro-batch {inputs.update_tokens}, log-prob pass {inputs.logprob_tokens} "
             f"({prompt_tokens} prompt tokens + flexrl.rollout.max_response_length per sample)", estimate.format()]
    for phase in estimate.over():
        lines.append(f"{phase}: " + ("; or ".join(estimate.advice(phase)) or "no setting found"))
    host_line, _ = host_verdict(estimate, num_ranks)
    if host_line and gb is None:  # this machine's host memory is the run's only where its GPU is measured here
        lines.append(host_line)
    return "\n".join(lines), estimate.fits()
