"""FlexUlysses forward + backward inside a DeepSpeed ZeRO-3 engine.

`build_engine` wraps `FlexUlyssesLM(hf_model)` in a ZeRO-3 engine (all parameters partitioned: the
persistence threshold is 0, so even a tiny model exercises the gathers). `flex_step_loss` computes
this rank's share of the step loss, normalised by the GLOBAL token count (all-reduced), and scaled
by the data-parallel world size because DeepSpeed averages gradients over ranks: the sum over ranks
of the local losses is then the single-process mean loss, and the averaged gradients equal the
single-process gradients. `full_grads` reads ZeRO-3's partitioned gradients back whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Zero3Config:
    """DeepSpeed settings of the FlexUlysses ZeRO-3 engine (the "flexrl" CPU test config by default)."""

    learning_rate: float = 1e-3
    """Learning rate of the torch optimizer handed to DeepSpeed (CPU: no fused Adam)."""
    persistence_threshold: int = 0
    """stage3_param_persistence_threshold: parameters smaller than this stay whole on every rank."""
    bf16: bool = False
    """Train in bf16 (GPU); fp32 otherwise."""
    reduce_bucket_size: int = 500_000_000
    """Elements per gradient reduce-scatter bucket (small values force many buckets: tests use that
    to check that ranks with different graphs still reduce the same parameters together)."""

    def deepspeed_config(self, world_size: int) -> dict:
        return {
            "train_micro_batch_size_per_gpu": 1,
            "train_batch_size": world_size,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": self.persistence_threshold,
                                  "stage3_max_live_parameters": 10**9, "stage3_prefetch_bucket_size": 0,
                                  "reduce_bucket_size": self.reduce_bucket_size},
            "bf16": {"enabled": self.bf16},
            "gradient_clipping": 0.0,
            "wall_clock_breakdown": False,
            "zero_allow_untested_optimizer": True,
        }


def build_engine(hf_model, config: Zero3Config | None = None, attention=None, vision_group=None):
    """A DeepSpeed ZeRO-3 engine around FlexUlyssesLM(hf_model); torch.distributed must be initialised."""
    import deepspeed
    import torch.distributed as dist

    from flexrl_ds.models.flex_model import FlexUlyssesLM

    config = config or Zero3Config()
    module = FlexUlyssesLM(hf_model, attention=attention, vision_group=vision_group)
    optimizer = torch.optim.SGD(module.parameters(), lr=config.learning_rate)
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer,
                                      config=config.deepspeed_config(dist.get_world_size()))
    return engine


def global_token_count(local_count: int, device=None, group=None) -> int:
    """Sum of every rank's loss tokens (all-reduce)."""
    import torch.distributed as dist

    count = torch.tensor([float(local_count)], device=device)
    if dist.is_initialized():
        dist.all_reduce(count, group=group)
    return int(count.item())


def flex_step_loss(engine, batch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(loss to backward, this rank's summed response NLL, global response tokens).

    loss = world_size * sum(local NLL) / global tokens + zero term, so that after DeepSpeed's
    gradient averaging the gradients are those of the single-process mean NLL.
    """
    import torch.distributed as dist

    logprobs, zero = engine(batch)
    mask = batch.response_mask.to(logprobs.device)
    local_nll = -(logprobs * mask).sum()
    num_global = global_token_count(int(mask.sum()), device=logprobs.device)
    if num_global == 0:
        raise ValueError("the step has no response tokens on any rank")
    world = dist.get_world_size() if dist.is_initialized() else 1
    loss = local_nll * (world / num_global) + zero
    return loss, local_nll.detach(), num_global


def full_grads(engine) -> dict[str, torch.Tensor]:
    """Whole (un-partitioned) gradient of every parameter after `engine.backward`, by HF name."""
    from deepspeed.utils import safe_get_full_grad

    out = {}
    for name, param in engine.module.hf_model.named_parameters():
        grad = safe_get_full_grad(param)
        if grad is not None:
            out[name] = grad.detach().float().cpu().clone()
    return out
