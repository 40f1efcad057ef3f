"""What `flexrl bench trl-peer` reports (pure: no torch, no TRL): the settings of our run that the
peer copies, TRL's arguments made from them, each step's figures, the text table, and the list of
what differs between TRL's run and ours.

`OurSettings.from_run_config` reads a run config (ds_configs/*.json) into the few values the peer
needs; `grpo_arguments` turns them into TRL `GRPOConfig` keywords; `differences` says, line by line,
what TRL's `GRPOTrainer` does otherwise than `flexrl train` with that config (what the peer cannot
copy). A step's figures use `flexrl train`'s definitions (docs/OUTPUTS.md): `tokens_per_gpu_s` is
the step's prompt and response tokens, each prompt counted once per sample, ÷ (step seconds × GPUs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class OurSettings:
    """What our run config says about the things the peer copies or reports as different."""

    learning_rate: float = 1e-6
    """The optimizer's lr (DeepSpeed `optimizer.params.lr`)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's betas."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    weight_decay: float = 0.0
    """AdamW's weight decay."""
    gradient_clipping: float = 1.0
    """DeepSpeed `gradient_clipping` (the peer's `max_grad_norm`)."""
    activation_checkpointing: bool = False
    """`flexrl.trainer.activation_checkpointing` (the peer's `gradient_checkpointing`)."""
    kl_coef: float = 0.0
    """`flexrl.rl.init_kl_coef` (the peer's `beta`; 0: no reference model in either)."""
    kl_estimator: str = "k3"
    """`flexrl.rl.kl_estimator` (TRL's KL term is k3)."""
    eps_clip_low: float = 0.2
    """PPO clip below (the peer's `epsilon`)."""
    eps_clip_high: float = 0.2
    """PPO clip above (the peer's `epsilon_high`)."""
    loss_reduction: str = "token_mean"
    """`flexrl.rl.loss_reduction`."""
    advantage_estimator: str = "group_norm"
    """`flexrl.rl.advantage_estimator`."""
    reward_fn: str = "keyword"
    """`flexrl.rl.reward_fn`: the peer scores with the same built-in (rl/rewards.py `REWARDS`)."""
    mini_batches_per_step: int = 1
    """Optimizer steps per step and epoch (the peer takes one)."""
    ppo_epochs: int = 1
    """Passes over the step's samples (the peer's `num_iterations`)."""
    temperature: float = 1.0
    """Rollout sampling temperature."""
    top_p: float = 1.0
    """Rollout top-p."""
    top_k: int = 0
    """Rollout top-k (0: off)."""
    backend: str = "hf"
    """`flexrl.rollout.backend`."""
    vllm_gpu_memory_utilization: float = 0.35
    """`flexrl.rollout.vllm.gpu_memory_utilization` (the peer's `vllm_gpu_memory_utilization`)."""
    vllm_max_model_len: int | None = None
    """`flexrl.rollout.vllm.max_model_len` (the peer's `vllm_max_model_length`; None: the model's)."""
    zero_stage: int = 3
    """DeepSpeed ZeRO stage of our policy."""
    optimizer_offload_ratio: float = 0.0
    """Share of our optimizer stepped on the host (DeepSpeed `offload_optimizer.ratio`; 0: none)."""
    max_tokens_per_rank: int | None = None
    """`flexrl.sp.max_tokens_per_rank`: our micro-batch cap in tokens."""
    loader_seed: int = 0
    """`flexrl.data.loader.seed`: the order of the records, which the peer follows."""
    global_batch: int = 4
    """`flexrl.data.loader.global_batch`: prompts per step."""
    num_samples_per_prompt: int = 4
    """`flexrl.data.loader.num_samples_per_prompt`."""
    max_response_length: int = 128
    """`flexrl.rollout.max_response_length`."""
    loader_shuffle: bool = True
    """`flexrl.data.loader.shuffle`."""

    @classmethod
    def from_run_config(cls, deepspeed: dict[str, Any], flexrl: Any) -> OurSettings:
        """From a loaded run config: its DeepSpeed part (a dict) and its typed `flexrl` part."""
        params = deepspeed.get("optimizer", {}).get("params", {})
        zero = deepspeed.get("zero_optimization", {})
        offload = zero.get("offload_optimizer") or {}
        offloaded = offload.get("device", "none") not in ("none", None)
        rl, rollout = flexrl.rl, flexrl.rollout
        return cls(
            learning_rate=float(params.get("lr", cls.learning_rate)),
            betas=tuple(params.get("betas", cls.betas)),  # type: ignore[arg-type]
            eps=float(params.get("eps", cls.eps)), weight_decay=float(params.get("weight_decay", 0.0)),
            gradient_clipping=float(deepspeed.get("gradient_clipping", 0.0)),
            activation_checkpointing=flexrl.trainer.activation_checkpointing,
            kl_coef=rl.init_kl_coef, kl_estimator=rl.kl_estimator, eps_clip_low=rl.eps_clip_low,
            eps_clip_high=rl.eps_clip_high, loss_reduction=rl.loss_reduction,
            advantage_estimator=rl.advantage_estimator, reward_fn=rl.reward_fn,
            mini_batches_per_step=rl.mini_batches_per_step, ppo_epochs=rl.ppo_epochs,
            temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k, backend=rollout.backend,
            vllm_gpu_memory_utilization=rollout.vllm.gpu_memory_utilization,
            vllm_max_model_len=rollout.vllm.max_model_len,
            zero_stage=int(zero.get("stage", 0)),
            optimizer_offload_ratio=float(offload.get("ratio", 1.0)) if offloaded else 0.0,
            max_tokens_per_rank=flexrl.sp.max_tokens_per_rank,
            loader_seed=flexrl.data.loader.seed, loader_shuffle=flexrl.data.loader.shuffle,
            global_batch=flexrl.data.loader.global_batch,
            num_samples_per_prompt=flexrl.data.loader.num_samples_per_prompt,
            max_response_length=rollout.max_response_length)


def grpo_arguments(ours: OurSettings, learning_rate: float | None, use_vllm: bool,
                   suppressed_token_ids: list[int]) -> dict[str, Any]:
    """TRL `GRPOConfig` keywords that copy `ours` where TRL has the setting (the batch, lengths and
    output keywords are the caller's). `suppressed_token_ids`: the vision placeholders and markers,
    never sampled by ours (rollout/base.py `SamplingParams`): -100 logit bias in vLLM as ours, HF
    generate's `suppress_tokens` (TRL alone suppresses only the image placeholder, and only there)."""
    suppress = ({"logit_bias": {token: -100.0 for token in suppressed_token_ids}} if use_vllm
                else {"suppress_tokens": list(suppressed_token_ids)})
    return {
        "learning_rate": ours.learning_rate if learning_rate is None else learning_rate,
        "adam_beta1": ours.betas[0], "adam_beta2": ours.betas[1], "adam_epsilon": ours.eps,
        "weight_decay": ours.weight_decay, "max_grad_norm": ours.gradient_clipping,
        "lr_scheduler_type": "constant",
        "gradient_checkpointing": ours.activation_checkpointing,
        "beta": ours.kl_coef, "epsilon": ours.eps_clip_low, "epsilon_high": ours.eps_clip_high,
        "loss_type": "dapo",  # token mean over the whole step's tokens, as our token_mean over the mini-batch
        "scale_rewards": "group", "num_iterations": ours.ppo_epochs,
        "temperature": ours.temperature, "top_p": ours.top_p, "top_k": ours.top_k,
        "use_vllm": use_vllm, "vllm_mode": "colocate",
        "vllm_gpu_memory_utilization": ours.vllm_gpu_memory_utilization,
        "vllm_max_model_length": ours.vllm_max_model_len, "vllm_enable_sleep_mode": use_vllm,
        # ours applies no rollout-vs-trainer correction unless flexrl.rl.tis_level is set (the shipped
        # files do not): TRL's default would add an old-policy pass and a sequence mask
        "vllm_importance_sampling_correction": False,
        "generation_kwargs": suppress,
    }


def differences(ours: OurSettings, use_vllm: bool, dtype: str, micro_batch: int,
                dropped_videos: int) -> list[str]:
    """What TRL's run does otherwise than ours with the same config, one line each."""
    return _system_lines(ours, use_vllm, dtype, micro_batch, dropped_videos) + _algorithm_lines(ours)


def _system_lines(ours: OurSettings, use_vllm: bool, dtype: str, micro_batch: int, dropped_videos: int) -> list[str]:
    offload = (f", {ours.optimizer_offload_ratio:.0%} of it on the host (DeepSpeed CPUAdam)"
               if ours.optimizer_offload_ratio else "")
    master = ("bf16 weights, gradients and AdamW moments (no fp32 master copy: TRL keeps the model in the "
              "dtype it loads), bf16 compute" if dtype == "bfloat16" else
              "fp32 weights, gradients and AdamW moments, bf16 autocast on a GPU")
    rollout = ("vLLM colocate: its own vLLM LLM in the process, started from the model folder's weights, "
               "max_num_batched_tokens 4096 (fixed by TRL), asleep at level 2 between steps, woken and given "
               "the module's weights by load_weights each step" if use_vllm else
               "HF generate (model.generate on the training module, left-padded prompts)")
    lines = [
        f"parallelism: TRL one process, a plain PyTorch module under accelerate (no DeepSpeed); ours a ZeRO-stage "
        f"{ours.zero_stage} DeepSpeed engine (fp32 master weights and moments{offload}), FlexUlysses on 1 rank",
        f"precision: TRL {master}; ours bf16 compute on fp32 master weights",
        f"rollout: TRL {rollout}; ours the {ours.backend} backend colocated (rollout/), its weights by ZeRO-3 "
        "gathers in buckets",
        f"micro-batches: TRL {micro_batch} completions per forward/backward, padded to the longest prompt (left) "
        "plus the longest completion (right); ours the step's samples unpadded in one pass unless they exceed "
        f"flexrl.sp.max_tokens_per_rank={ours.max_tokens_per_rank} (then the fewest micro-batches), short ones packed",
        "attention: TRL the model's own (sdpa on the padded batch; the vision tower as transformers runs it, one "
        "call per window); ours FlexUlysses varlen per sequence, the vision tower's varlen (one call per layer)",
        "log-probs: TRL 1.16's fused LM head (tiles over the completion positions, no [tokens x vocabulary] "
        "block); ours chunked by bytes at the response rows only, each chunk recomputed in the backward",
        "data: TRL decodes the images in the training process (a datasets Image column) and runs the processor "
        "there each step, twice (generation, then the forward's pixel values); ours the ShadowLoader's actors",
        ("prompts: the same records in the same order (our loader's seeded order)" if not dropped_videos else
         f"prompts: our loader's seeded order without its {dropped_videos} video record(s): TRL's GRPOTrainer "
         "takes images only (its `images` column), so steps hold other prompts than ours")
        + "; rendered with the model's chat template in both (TRL's processor, ours media/ and models/processing.py)",
    ]
    return lines


def _algorithm_lines(ours: OurSettings) -> list[str]:
    reference = (f"both with KL coefficient {ours.kl_coef} in the loss: TRL a second full copy of the model on the "
                 "device, k3; ours a second ZeRO-3 engine, " + ours.kl_estimator if ours.kl_coef else
                 "none in either (KL coefficient 0)")
    single = ours.mini_batches_per_step == 1 and ours.ppo_epochs == 1
    return [
        f"reference model: {reference}",
        f"loss: TRL loss_type dapo (token mean over the step's tokens), clip {ours.eps_clip_low}/"
        f"{ours.eps_clip_high}, advantages normalised per group (std + 1e-4); ours {ours.loss_reduction}, same "
        f"clip, {ours.advantage_estimator}",
        f"optimizer steps: TRL one per step (gradients accumulated over its micro-batches); ours "
        f"{ours.mini_batches_per_step} mini-batch(es) x {ours.ppo_epochs} epoch(s)",
        ("old-policy pass: neither (one mini-batch, one epoch: the update's forward is the old policy); "
         if single else "old-policy pass: ours runs one (several mini-batches or epochs), TRL none; ")
        + "TRL's vLLM importance-sampling correction off, as ours has no TIS in the shipped configs",
        f"learning rate {ours.learning_rate}: TRL constant; ours the config's scheduler (the shipped files warm up "
        "from 0.1 x lr over 5 steps)",
        "sampling: same temperature/top-p/top-k and the vision tokens suppressed in both; different random "
        "streams (TRL's seed; ours per-sample seeds)",
    ]


@dataclass
class StepFigures:
    """One step of the peer, with `flexrl train`'s definitions."""

    step: int
    step_s: float
    """Seconds from the previous step's end (or the start of training) to this step's end: data,
    generation, rewards, log-prob passes, forward/backward, optimizer step and the weight push."""
    num_completions: int
    generated_tokens: int
    """Completion tokens of the step, as the reward function received them (ends at EOS)."""
    prompt_tokens: int
    """Prompt tokens, each prompt once per completion (TRL's `num_tokens` growth minus the generated)."""
    tokens_per_gpu_s: float
    peak_allocated_gb: float
    """torch's peak allocated bytes over the step (GiB; 0 on CPU)."""
    peak_device_used_gb: float
    """Peak device memory in use, every allocator (vLLM's pool too), sampled (GiB; 0 on CPU)."""
    reward_mean: float
    trl_mean_length: float
    """TRL's own `completions/mean_length` (its completion mask), for the check against ours."""
    trl_step_time: float = 0.0
    """TRL's own `step_time` metric (its generation and scoring of the step, seconds)."""


def step_figures(step: int, step_s: float, completion_lengths: list[int], rewards: list[float],
                 num_tokens_before: float, num_tokens_after: float, trl_logs: dict[str, float],
                 peaks_bytes: tuple[int, int], num_gpus: int = 1) -> StepFigures:
    """A step's figures from what the callback and the reward function saw."""
    generated = sum(completion_lengths)
    total = int(round(num_tokens_after - num_tokens_before))
    return StepFigures(
        step=step, step_s=step_s, num_completions=len(completion_lengths), generated_tokens=generated,
        prompt_tokens=total - generated, tokens_per_gpu_s=total / num_gpus / max(step_s, 1e-9),
        peak_allocated_gb=peaks_bytes[0] / 2**30, peak_device_used_gb=peaks_bytes[1] / 2**30,
        reward_mean=sum(rewards) / max(len(rewards), 1),
        trl_mean_length=float(trl_logs.get("completions/mean_length", 0.0)),
        trl_step_time=float(trl_logs.get("step_time", 0.0)))


def format_table(steps: list[StepFigures]) -> str:
    """The per-step table printed and written beside the JSON."""
    header = (f"{'step':>4} {'step_s':>8} {'compl':>6} {'gen_tok':>8} {'prompt_tok':>10} {'tok/GPU/s':>10} "
              f"{'alloc_GiB':>9} {'used_GiB':>9} {'reward':>7}")
    rows = [f"{s.step:>4} {s.step_s:>8.2f} {s.num_completions:>6} {s.generated_tokens:>8} {s.prompt_tokens:>10} "
            f"{s.tokens_per_gpu_s:>10.0f} {s.peak_allocated_gb:>9.1f} {s.peak_device_used_gb:>9.1f} "
            f"{s.reward_mean:>7.3f}" for s in steps]
    return "\n".join([header, *rows])


def result_json(steps: list[StepFigures], setup: dict[str, Any], diff_lines: list[str]) -> dict[str, Any]:
    """The JSON written by `--json`: the setup, each step, the differences."""
    return {"setup": setup, "steps": [asdict(s) for s in steps], "differences": diff_lines}
