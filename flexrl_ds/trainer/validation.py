"""Checks a training run's inputs before any worker starts; each failure names its cause.

`check_run(run, model_dir, num_ranks)` raises ValueError for: a missing or text-only model directory, an
inconsistent config (batch not divisible over the ranks, SP domains that do not divide the ranks,
p_max over the SP domain, a mini-batch with fewer samples than domains, mini-batches that
do not divide the prompts, a group size n of 1 (every advantage would be 0), `flexrl.sp.oversize`
other than error, a DeepSpeed setting the trainer owns, a tensor-parallel engine that is colocated
or not one GPU per shard) and a vllm backend on a machine without GPUs. `ignored_settings` names
the engine settings a colocated run does not use (printed, not refused). `launch.prepare` then loads the reward
(an unknown name, a missing file or function fails there) and reads the dataset
(`data_controller.usable_records`), still before any worker starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from flexrl_ds.common.json_files import looked_for, read_json
from flexrl_ds.families import family_of_dir
from flexrl_ds.models.zero3 import check_ds_config
from flexrl_ds.parallel import device as device_mod
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.trainer.samples import sequence_token_limit

if TYPE_CHECKING:
    from flexrl_ds.rollout.config import RolloutConfig


def check_model_dir(model_dir: str) -> None:
    path = Path(model_dir)
    if not path.is_dir():
        raise ValueError(f"--model {model_dir}: no such directory{looked_for(path)}")
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model_dir}: no config.json there (an HF model directory is needed; "
                         "`flexrl make-tiny-model --out DIR` writes a tiny random one)")
    config = read_json(path / "config.json", "model config")
    if isinstance(config, dict) and "vision_config" not in config:
        raise ValueError(f"--model {model_dir}: a text-only model (model_type {config.get('model_type')!r}, no "
                         "vision_config); flexrl train trains vision-language models "
                         "(Qwen2.5-VL, Qwen3-VL, Qwen3-VL MoE) "
                         "(`flexrl make-tiny-model --arch qwen2.5-vl` writes a tiny random one)")
    family_of_dir(path)  # a family flexrl_ds cannot shard is refused here, naming it and why


def check_batch(flexrl: Any, num_ranks: int) -> None:
    loader, rl = flexrl.data.loader, flexrl.rl
    samples = loader.global_batch * loader.num_samples_per_prompt
    if samples % num_ranks:
        raise ValueError(
            f"flexrl.data.loader: global_batch {loader.global_batch} x num_samples_per_prompt "
            f"{loader.num_samples_per_prompt} = {samples} samples per step do not divide over "
            f"flexrl.trainer.num_policy_ranks = {num_ranks}")
    if loader.global_batch % rl.mini_batches_per_step:
        raise ValueError(f"flexrl.rl.mini_batches_per_step {rl.mini_batches_per_step} does not divide "
                         f"flexrl.data.loader.global_batch {loader.global_batch} (mini-batches hold whole prompt "
                         "groups)")
    check_domains(flexrl, num_ranks)
    if loader.num_samples_per_prompt < 2:  # every estimator compares a sample with its group's others
        raise ValueError(f"flexrl.rl.advantage_estimator {rl.advantage_estimator!r} needs "
                         f"flexrl.data.loader.num_samples_per_prompt >= 2, got {loader.num_samples_per_prompt}: "
                         "a prompt's only sample has advantage 0, so only the KL term would train")
    if flexrl.sp.oversize != "error":
        raise ValueError(f"flexrl.sp.oversize: {flexrl.sp.oversize!r} is for the planning tools; `flexrl train` "
                         "trains every sample it rolls out, so it takes 'error': it sets aside, before their "
                         "rollout and named, the prompts whose samples could exceed flexrl.sp.max_tokens_per_rank "
                         "x the largest degree")
    if flexrl.rollout.temperature == 0:
        raise ValueError("flexrl.rollout.temperature: 0 (greedy) gives every sample of a prompt the same "
                         "response, so every advantage would be 0 and no update would follow the reward; "
                         "training needs a temperature > 0 (1.0 samples the policy itself)")


def check_domains(flexrl: Any, num_ranks: int) -> None:
    """SP domains: `flexrl.sp.domain_size` (None: all ranks) divides the policy ranks, holds p_max,
    and every mini-batch has a sample for each domain (a domain without one would idle through
    every pass: devices given to the run and never used)."""
    loader, sp = flexrl.data.loader, flexrl.sp
    domain = sp.domain_ranks(num_ranks)
    if num_ranks % domain:
        raise ValueError(f"flexrl.sp.domain_size {domain} does not divide flexrl.trainer.num_policy_ranks = "
                         f"{num_ranks}")
    if sp.p_max > domain:
        is_default = sp.p_max == type(sp)().p_max
        default = f" ({sp.p_max} is also its default, where flexrl.sp sets none)" if is_default else ""
        widest = 1 << (domain.bit_length() - 1)  # p_max is a power of two
        more = "raise flexrl.sp.domain_size" if sp.domain_size else "run more ranks"
        raise ValueError(f"flexrl.sp.p_max {sp.p_max} exceeds the SP domain of {domain} ranks "
                         f"(flexrl.sp.domain_size, default flexrl.trainer.num_policy_ranks = {num_ranks}): set "
                         f"flexrl.sp.p_max to {widest} or less, or {more}{default}")
    per_mini_batch = loader.global_batch // flexrl.rl.mini_batches_per_step * loader.num_samples_per_prompt
    if per_mini_batch < num_ranks // domain:
        raise ValueError(f"a mini-batch holds {per_mini_batch} samples, fewer than the {num_ranks // domain} SP "
                         "domains (flexrl.sp.domain_size): raise global_batch or lower mini_batches_per_step")


def check_engine_placement(flexrl: Any) -> None:
    """The chosen backend's engines can run where the run puts them (its options say: a
    tensor-parallel vLLM engine is a separate engine with one whole GPU per shard)."""
    flexrl.rollout.options.check_placement(flexrl.rollout, colocated=flexrl.trainer.colocate)


SEPARATE_ENGINE_SETTINGS = ("num_engines", "num_cpus_per_engine", "num_gpus_per_engine")
"""`flexrl.rollout` keys only separate engines use (colocated: one engine inside each policy rank)."""


def ignored_settings(flexrl: Any, spmd_world: int | None = None) -> list[str]:
    """Lines naming the settings this run ignores: the `flexrl.rollout` engine settings set away from
    their defaults when engines are colocated, under `--spmd` (`spmd_world`: the launcher's ranks)
    `flexrl.trainer.colocate` false and `num_policy_ranks`, and the reference's offload without a
    reference (`flexrl.rl.init_kl_coef` 0)."""
    trainer, lines = flexrl.trainer, []
    if trainer.reference_offload_param and flexrl.rl.init_kl_coef == 0:
        lines.append("flexrl.trainer.reference_offload_param = true is ignored: flexrl.rl.init_kl_coef is 0, "
                     "so the run builds no reference model")
    if spmd_world is not None:
        if not trainer.colocate:
            lines.append("flexrl.trainer.colocate = false is ignored under --spmd: the engines run inside the ranks")
        if trainer.num_policy_ranks != spmd_world:
            lines.append(f"flexrl.trainer.num_policy_ranks = {trainer.num_policy_ranks} is ignored under --spmd: "
                         f"the launcher started {spmd_world} ranks")
        if trainer.max_restarts:
            lines.append(f"flexrl.trainer.max_restarts = {trainer.max_restarts} is ignored under --spmd: a lost rank "
                         "ends the launcher's job (start it again with --resume)")
    elif not trainer.colocate:
        return lines
    defaults = type(flexrl.rollout)()
    changed = [name for name in SEPARATE_ENGINE_SETTINGS if getattr(flexrl.rollout, name) != getattr(defaults, name)]
    return lines + [f"flexrl.rollout.{name} = {getattr(flexrl.rollout, name)} is ignored: each policy rank holds "
                    "one engine" for name in changed]


def check_run(run: Any, model_dir: str, num_ranks: int) -> None:
    """Everything that can be checked on the driver before workers start."""
    check_model_dir(model_dir)
    check_batch(run.flexrl, num_ranks)
    check_ds_config(run.deepspeed, num_ranks, train=True)
    check_engine_placement(run.flexrl)
    if run.flexrl.rollout.options.needs_gpu and not device_mod.detect().is_gpu:
        raise ValueError(f"flexrl.rollout.backend {run.flexrl.rollout.backend!r} needs GPUs; this machine has none "
                         "(use 'hf')")
    check_sequence_room(run.flexrl, model_dir, num_ranks)


def check_sequence_room(flexrl: Any, model_dir: str, num_ranks: int) -> None:
    """Under `flexrl.sp.max_tokens_per_rank` a sequence holds at most the cap × the largest degree
    (trainer/samples.py `sequence_token_limit`): refused when the longest response alone fills that,
    since every prompt would be set aside at every step."""
    sp, longest = flexrl.sp, flexrl.rollout.max_response_length
    limit = sequence_token_limit(sp, load_cost_model(sp.cost_model or model_dir, None), sp.domain_ranks(num_ranks))
    if limit is not None and longest >= limit.tokens:
        raise ValueError(f"flexrl.rollout.max_response_length {longest}: a sequence may hold {limit.tokens} tokens "
                         f"({limit.explained(sp.max_tokens_per_rank)}), so no prompt fits next to the longest response")


def resolve_media_limits(rollout: RolloutConfig, records: list) -> RolloutConfig:
    """The rollout config with what the chosen backend's options derive from the run's records filled
    in (`BackendOptions.resolved_for`: vllm's per-prompt image/video limits), the same object where
    nothing changes; a ValueError names a record they cannot serve."""
    return rollout.with_options(rollout.options.resolved_for(records))


def model_dtype(ds_config: dict) -> str:
    """bfloat16 when the DeepSpeed config enables bf16, else float32."""
    return "bfloat16" if ds_config.get("bf16", {}).get("enabled") else "float32"


DTYPE_NAMES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
               "bf16": "bfloat16", "bfloat16": "bfloat16"}


def gradient_accumulation_dtype(ds_config: dict) -> str:
    """The dtype ZeRO-3 adds a mini-batch's micro-batch gradients in: DeepSpeed's
    `data_types.grad_accum_dtype` where set, else the model's."""
    asked = (ds_config.get("data_types") or {}).get("grad_accum_dtype")
    return model_dtype(ds_config) if asked is None else DTYPE_NAMES.get(str(asked).lower(), str(asked))
