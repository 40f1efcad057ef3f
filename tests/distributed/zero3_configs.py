"""DeepSpeed JSON dicts for the distributed tests (what a run config's DeepSpeed part holds)."""

from __future__ import annotations


def zero3_config(lr: float = 1e-3, reduce_bucket_size: int = 500_000_000, gradient_clipping: float = 0.0,
                 weight_decay: float = 0.0, betas=(0.9, 0.999), eps: float = 1e-8,
                 offload_optimizer: str = "none") -> dict:
    """ZeRO-3 with every parameter partitioned (persistence threshold 0, so even a tiny model
    exercises the gathers), fp32, AdamW through torch (no fused-Adam build on CPU).
    offload_optimizer, in several sub-groups:
    - "torch_adam": all optimizer states in host memory, stepped by torch's AdamW there;
    - "cpu_adam_ratio": half of them there, stepped by DeepSpeed's CPUAdam (JIT-built), the other
      half where the model is, as the 7B-on-one-GPU run configures it (ratio 0.7 there)."""
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "eps": eps,
                                                  "weight_decay": weight_decay, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_max_live_parameters": 10**9, "stage3_prefetch_bucket_size": 0,
                              "reduce_bucket_size": reduce_bucket_size},
        "gradient_clipping": gradient_clipping,
        "wall_clock_breakdown": False,
    }
    if offload_optimizer == "torch_adam":
        config["zero_optimization"].update(offload_optimizer={"device": "cpu", "pin_memory": False},
                                           sub_group_size=50_000)
        config["zero_force_ds_cpu_optimizer"] = False
    elif offload_optimizer == "cpu_adam_ratio":
        config["optimizer"]["params"].pop("torch_adam")
        config["zero_optimization"].update(offload_optimizer={"device": "cpu", "pin_memory": False, "ratio": 0.5},
                                           sub_group_size=50_000)
    elif offload_optimizer != "none":
        raise ValueError(f"offload_optimizer: none | torch_adam | cpu_adam_ratio, got {offload_optimizer!r}")
    return config
