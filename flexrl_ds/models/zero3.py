"""FlexUlysses inside a DeepSpeed ZeRO-3 engine, configured by the run config's DeepSpeed JSON as written.

`build_engine(hf_model, ds_config)` wraps `FlexUlyssesLM(hf_model)` and hands `ds_config` (the run
config without its `flexrl` key) to `deepspeed.initialize(config=...)` unchanged: DeepSpeed builds the
optimizer from its `optimizer` block (on CPU `"torch_adam": true` avoids compiling fused Adam), the
scheduler, bf16/fp32, ZeRO-3 buckets and offload, gradient clipping. Settings the trainer owns are
checked first (`check_ds_config`) and rejected with a `ValueError` naming the key, never overridden:

- `zero_optimization.stage` must be 3 (parameters, gradients and optimizer states partitioned);
- `gradient_accumulation_steps` must be 1 (absent: 1): the trainer calls `engine.step()` once per
  mini-batch, whose loss is already normalised by the mini-batch's global token count;
- the micro-batch must be 1 (each rank takes one packed batch per pass), whether
  `train_micro_batch_size_per_gpu` says it or `train_batch_size` over the data-parallel ranks does;
- `sequence_parallel_size` other than 1: FlexUlysses owns sequence parallelism;
- `train=True` needs an `optimizer` block (no client optimizer is passed) whose `type`, and the
  `scheduler`'s, DeepSpeed knows (it would refuse them only inside the ranks); `train=False` builds an
  inference engine (the reference model): ZeRO-3 partitioned parameters and no optimizer, so the
  `optimizer` and `scheduler` blocks are left out there (the same JSON serves both engines).

DeepSpeed passes over keys it does not know: `build_engine` records the top-level keys DeepSpeed
asks for while it initialises (`AskedKeys`), and a policy engine's rank 0 names the config's keys it
never read, with the key it did ask for that a typo was most likely meant as (`unread_keys_note`).

`flex_step_loss` is the plain NLL step loss (all-reduced global token count; scaled by the
data-parallel world size because DeepSpeed averages gradients over ranks). `full_grads` reads
ZeRO-3's partitioned gradients back whole.
"""

from __future__ import annotations

import copy
import difflib
import sys
from typing import Any

import torch
import torch.distributed as dist

from flexrl_ds.common import notes
from flexrl_ds.models.flex_model import FlexUlyssesLM
from flexrl_ds.models.logprob_chunks import DEFAULT_CHUNK_BYTES
from flexrl_ds.parallel.device import to_device

INFERENCE_DROPPED_KEYS = ("optimizer", "scheduler")
"""Blocks an inference engine (train=False) does not use."""


class AskedKeys(dict):
    """A DeepSpeed config that records every top-level key read from it, present or not (copies
    made with `copy.copy`, as DeepSpeed makes, share the record). Pickled as a plain dict: DeepSpeed
    saves its config into checkpoints, which must load without flexrl_ds."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.asked: set[str] = set()

    def __copy__(self) -> "AskedKeys":
        copied = AskedKeys(self)
        copied.asked = self.asked
        return copied

    def __reduce__(self):
        return dict, (dict(self),)

    def get(self, key, default=None):
        self.asked.add(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self.asked.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.asked.add(key)
        return super().__contains__(key)


def unread_keys_note(config: dict[str, Any], asked: set[str]) -> str | None:
    """A line naming the keys of `config` DeepSpeed never read (no effect on the run), each with the
    key it asked for that the name is closest to, if any; None when it read them all."""
    unread = sorted(set(config) - asked)
    if not unread:
        return None
    candidates = sorted(asked - set(config))
    hints = []
    for key in unread:
        match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.8)
        hints.append(f"{key!r}" + (f" (did you mean {match[0]!r}?)" if match else ""))
    return f"DeepSpeed config: DeepSpeed did not read {', '.join(hints)}: no effect on this run"


def check_ds_config(ds_config: dict[str, Any], world_size: int, train: bool = True) -> None:
    """ValueError naming the key if `ds_config` sets something the trainer must own (see module doc)."""
    if not isinstance(ds_config, dict):
        raise ValueError(f"DeepSpeed config: must be a JSON object, got {type(ds_config).__name__}")
    if "flexrl" in ds_config:
        raise ValueError("DeepSpeed config: pass the run config without its 'flexrl' section "
                         "(config.flexrl_config.load_run_config(...).deepspeed)")
    zero = ds_config.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    if stage != 3:
        raise ValueError(f"zero_optimization.stage: must be 3 (FlexUlysses runs on ZeRO-3), got {stage!r}")
    accumulation = ds_config.get("gradient_accumulation_steps", 1)
    if accumulation != 1:
        raise ValueError(f"gradient_accumulation_steps: must be 1, got {accumulation!r}: the trainer calls "
                         "engine.step() once per mini-batch (set flexrl.rl.mini_batches_per_step instead)")
    _check_batch_sizes(ds_config, world_size)
    if ds_config.get("sequence_parallel_size", 1) != 1:
        raise ValueError(f"sequence_parallel_size: must be 1 (got {ds_config['sequence_parallel_size']!r}): "
                         "FlexUlysses plans sequence parallelism per sequence (flexrl.sp)")
    if train and not isinstance(ds_config.get("optimizer"), dict):
        raise ValueError("optimizer: a training engine needs DeepSpeed's optimizer block, e.g. "
                         '{"type": "AdamW", "params": {"lr": 1e-6, "torch_adam": true}}')
    if train:
        check_optimizer_and_scheduler_types(ds_config)


def _check_batch_sizes(ds_config: dict[str, Any], world_size: int) -> None:
    """A micro-batch of 1 per rank, given outright or through `train_batch_size` (DeepSpeed divides it
    by the ranks): each rank takes one packed FlexUlysses batch per pass, whatever the JSON says."""
    micro = ds_config.get("train_micro_batch_size_per_gpu")
    total = ds_config.get("train_batch_size")
    if micro is None and total is None:
        raise ValueError("train_micro_batch_size_per_gpu: required: 1 (the trainer feeds one packed "
                         "FlexUlysses batch per rank and pass)")
    if micro is None:
        key, micro = f"train_batch_size {total} over {world_size} ranks", total / world_size
    else:
        key = "train_micro_batch_size_per_gpu"
    if micro != 1:
        raise ValueError(f"{key}: the micro-batch must be 1, got {micro:g}: each rank takes one packed "
                         "FlexUlysses batch per pass, whatever it says. Samples per step come from "
                         "flexrl.data.loader (global_batch x num_samples_per_prompt); passes are split where "
                         "flexrl.sp.max_tokens_per_rank asks")
    if total is not None and total != world_size:
        raise ValueError(f"train_batch_size: {total} != train_micro_batch_size_per_gpu 1 x "
                         f"{world_size} data-parallel ranks (x gradient_accumulation_steps 1)")


def check_optimizer_and_scheduler_types(ds_config: dict[str, Any]) -> None:
    """ValueError naming `optimizer.type` or `scheduler.type` where DeepSpeed would refuse the name,
    which it does only inside every rank, as its engines are built. torch's own classes pass without
    importing DeepSpeed (its import warns on a driver without GPUs)."""
    scheduler_block = ds_config.get("scheduler")
    if scheduler_block is not None and not isinstance(scheduler_block, dict):
        raise ValueError(f"scheduler: expected an object with a 'type' and 'params', got {scheduler_block!r}")
    _check_optimizer_type(ds_config["optimizer"].get("type"))
    _check_scheduler_type((scheduler_block or {}).get("type"))


def _check_optimizer_type(name: Any) -> None:
    """DeepSpeed takes its own optimizers in any case, and any torch.optim class (engine.py)."""
    if not isinstance(name, str) or hasattr(torch.optim, name):
        return
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS  # lazy: only names torch lacks need it

    if name.lower() in DEEPSPEED_OPTIMIZERS:
        return
    own = sorted(DEEPSPEED_OPTIMIZERS)
    torch_classes = [known for known in dir(torch.optim) if known[:1].isupper() and known != "Optimizer"]
    raise ValueError(f"optimizer.type: DeepSpeed knows no optimizer {name!r}{_meant(name, own + torch_classes)} "
                     f"(its own: {', '.join(own)}; or a torch.optim class)")


def _check_scheduler_type(name: Any) -> None:
    """DeepSpeed takes its own schedules (runtime/lr_schedules.py) and any torch.optim.lr_scheduler class."""
    if not isinstance(name, str) or hasattr(torch.optim.lr_scheduler, name):
        return
    from deepspeed.runtime import lr_schedules  # lazy: only names torch lacks need it

    if hasattr(lr_schedules, name):
        return
    own = list(lr_schedules.VALID_LR_SCHEDULES)
    torch_classes = [known for known in dir(torch.optim.lr_scheduler) if known.endswith("LR")]
    raise ValueError(f"scheduler.type: DeepSpeed knows no scheduler {name!r}{_meant(name, own + torch_classes)} "
                     f"(its own: {', '.join(own)}; or a torch.optim.lr_scheduler class)")


def _meant(name: str, known: list[str]) -> str:
    """" (did you mean 'X'?)" for the known name closest to `name`, ignoring case; "" if none is close."""
    by_lower = {known_name.lower(): known_name for known_name in known}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[close[0]]!r}?)" if close else ""


def build_engine(hf_model, ds_config: dict[str, Any], attention=None, vision_group=None, train: bool = True,
                 logits_chunk: int | None = None, activation_checkpointing: bool = False, temperature: float = 1.0,
                 vision_attention: str = "varlen", logits_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 leaf_layers: bool = False):
    """A DeepSpeed ZeRO-3 engine around `FlexUlyssesLM(hf_model)`, configured by `ds_config` as written.

    torch.distributed (and deepspeed.comm) must be initialised. `attention` / `vision_group` /
    `logits_chunk` / `logits_chunk_bytes` / `temperature` / `vision_attention`: see `FlexUlyssesLM`.
    `train=False`: the reference model's inference engine.
    `activation_checkpointing`: every decoder and vision layer is recomputed in backward
    (transformers' non-reentrant gradient checkpointing: ZeRO-3 gathers the layer's parameters
    again, and its FlexUlysses all-to-alls run again, in the same order on every rank).
    The module's `zero_group` is set to the group its parameters are partitioned over. A family's
    sparse MoE blocks (`ModelFamily.zero3_leaf_modules`) become ZeRO-3 leaf modules (DeepSpeed
    `set_z3_leaf_modules`): gathered whole, so ranks whose tokens route to different experts run the
    same parameter gathers. `leaf_layers`: every decoder layer and vision block is a ZeRO-3 leaf too
    (`layer_classes`; `flexrl.trainer.zero3_leaf_layers`): one fetch and one release per layer
    instead of one per module (~20x fewer hook calls; docs/notes/zero3-one-rank-host-cost.md).
    """
    import deepspeed

    check_ds_config(ds_config, dist.get_world_size(), train)
    config = copy.deepcopy(ds_config)  # DeepSpeed may write into the dict it is given
    if not train:
        for key in INFERENCE_DROPPED_KEYS:
            config.pop(key, None)
    if activation_checkpointing:
        enable_activation_checkpointing(hf_model)
    module = FlexUlyssesLM(hf_model, attention=attention, vision_group=vision_group, logits_chunk=logits_chunk,
                           temperature=temperature, vision_attention=vision_attention,
                           logits_chunk_bytes=logits_chunk_bytes)
    leaves = module.family.zero3_leaf_modules(hf_model) + (layer_classes(hf_model) if leaf_layers else [])
    if leaves:  # a sparse MoE block is gathered whole: ranks routing to other experts gather the same
        from deepspeed.utils import set_z3_leaf_modules  # lazy: DeepSpeed is imported inside build_engine

        set_z3_leaf_modules(module, leaves)
    parameters = [p for p in module.parameters() if p.requires_grad] if train else None
    config = AskedKeys(config)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=parameters, config=config)
    module.zero_group = engine.seq_data_parallel_group
    module.unread_config_keys = tuple(sorted(set(config) - config.asked))
    note = unread_keys_note(config, config.asked)
    if note and train and dist.get_rank() == 0:  # the reference engine reads the same JSON: said once
        notes.say(note)
    if train:
        start_warmup(engine)
        engine.train()  # models load in eval mode; transformers recomputes layers only in training mode
    else:
        engine.eval()
    return engine


LAYER_LISTS = ("layers", "blocks")
"""Names of the `ModuleList`s whose children are a model's repeated layers (decoder layers, vision blocks)."""


def layer_modules(hf_model) -> list[tuple[str, torch.nn.Module]]:
    """(qualified name, module) of the children of every `ModuleList` named in `LAYER_LISTS`: the
    model's repeated layers (decoder layers, vision blocks)."""
    return [(f"{name}.{child_name}", child) for name, module in hf_model.named_modules()
            if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in LAYER_LISTS
            for child_name, child in module.named_children()]


def layer_classes(hf_model) -> list[type]:
    """Classes of `layer_modules`: the modules `build_engine(leaf_layers=True)` makes ZeRO-3 leaves."""
    return list(dict.fromkeys(type(module) for _, module in layer_modules(hf_model)))


def persistent_names(model: torch.nn.Module, threshold: int, model_threshold: int = sys.maxsize) -> list[str]:
    """Names of the parameters DeepSpeed keeps whole on every rank under `stage3_param_persistence_threshold`
    `threshold` and `stage3_model_persistence_threshold` `model_threshold`: those of at most `threshold`
    elements, in module order, while their sum stays within `model_threshold`."""
    names, total = [], 0
    for name, parameter in model.named_parameters():
        if parameter.numel() <= threshold and total + parameter.numel() <= model_threshold:
            names.append(name)
            total += parameter.numel()
    return names


def persistent_elements(model: torch.nn.Module, threshold: int, model_threshold: int = sys.maxsize) -> int:
    """Elements of `persistent_names`' parameters."""
    sizes = dict(model.named_parameters())
    return sum(sizes[name].numel() for name in persistent_names(model, threshold, model_threshold))


WARMUP_SCHEDULES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
"""DeepSpeed's schedules that hold the learning rate at 0 until their first step."""


def start_warmup(engine) -> None:
    """Step a fresh DeepSpeed warm-up schedule (WARMUP_SCHEDULES) once, to its iteration 0: until
    then it holds the learning rate at 0, so the first optimizer step, all of a GRPO run's step 0
    with one mini-batch, would not train. Its first step then runs at the warm-up's start
    (`warmup_min_ratio` x lr, `warmup_min_lr`), and the schedule reaches its end one step early. A
    resumed engine gets the checkpoint's schedule position over this one."""
    scheduler = getattr(engine, "lr_scheduler", None)
    if type(scheduler).__name__ in WARMUP_SCHEDULES and getattr(scheduler, "last_batch_iteration", None) == -1:
        scheduler.step()


def with_schedule_length(ds_config: dict[str, Any], optimizer_steps: int) -> dict[str, Any]:
    """The DeepSpeed config with a `scheduler.params.total_num_steps` of "auto" (the shipped configs')
    set to `optimizer_steps` (`flexrl train`: max_steps x mini_batches_per_step x ppo_epochs)."""
    params = (ds_config.get("scheduler") or {}).get("params") or {}
    if params.get("total_num_steps") != "auto":
        return ds_config
    scheduler = {**ds_config["scheduler"], "params": {**params, "total_num_steps": optimizer_steps}}
    return {**ds_config, "scheduler": scheduler}


def with_param_offload(ds_config: dict[str, Any]) -> dict[str, Any]:
    """A copy of `ds_config` whose ZeRO-3 parameters live in pinned host memory, fetched to the
    device module by module as a pass needs them (`zero_optimization.offload_param`)."""
    config = copy.deepcopy(ds_config)
    config["zero_optimization"] = {**config.get("zero_optimization", {}),
                                   "offload_param": {"device": "cpu", "pin_memory": True}}
    return config


def enable_activation_checkpointing(hf_model) -> None:
    """transformers' non-reentrant layer checkpointing (`activation_checkpointing_enable` in newer
    transformers, e.g. 5.24; `gradient_checkpointing_enable` in older ones, e.g. the GPU machine's 5.17)."""
    options = {"use_reentrant": False}
    if hasattr(hf_model, "activation_checkpointing_enable"):
        hf_model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)


def data_parallel_size(engine) -> int:
    """Ranks DeepSpeed averages gradients over (the ZeRO-3 partition group)."""
    return dist.get_world_size(engine.seq_data_parallel_group) if dist.is_initialized() else 1


def global_token_count(local_count: int, device=None, group=None) -> int:
    """Sum of every rank's loss tokens (all-reduce)."""
    count = torch.tensor([float(local_count)], dtype=torch.float64)  # exact past 2**24 tokens
    if device is not None:  # read back below anyway; sent without a second wait
        count = to_device(count, torch.device(device))
    if dist.is_initialized():
        dist.all_reduce(count, group=group)
    return int(count.item())


def flex_step_loss(engine, batch) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(loss to backward, this rank's summed response NLL, global response tokens).

    loss = world_size * sum(local NLL) / global tokens + zero term, so that after DeepSpeed's
    gradient averaging the gradients are those of the single-process mean NLL.
    """
    logprobs, _, zero = engine(batch)
    mask = to_device(batch.response_mask, logprobs.device)
    local_nll = -torch.where(mask, logprobs, 0.0).sum()
    num_global = global_token_count(int(batch.response_mask.sum()), device=logprobs.device)
    if num_global == 0:
        raise ValueError("the step has no response tokens on any rank")
    loss = local_nll * (data_parallel_size(engine) / num_global) + zero
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


STATES_ANY_OPTIMIZER = ("lp_params", "lp_grads", "contiguous_grad_buffer")
"""ZeRO-3 states (DeepSpeed's `OffloadStateTypeEnum` names) that DeepSpeed 0.19 moves to host memory
whatever the optimizer: the parameter partitions in the training dtype, their gradient partitions and
the gradient buckets. The fp32 master weights and the optimizer moments move only under its FusedAdam."""


class RolloutOffload:
    """A policy engine's ZeRO-3 states in host memory while a colocated rollout engine generates
    (`offload`), and back on the device for the next pass (`reload`).

    Whatever DeepSpeed can move is moved:
    - under DeepSpeed's FusedAdam, every state;
    - with the optimizer offloaded (`offload_optimizer`), DeepSpeed itself leaves out the fp32 master
      weights, the moments and the gradients, wherever they are (also the share a `ratio` below 1
      keeps on the device): the parameters and the gradient buckets move;
    - under any other optimizer on the device (torch's AdamW, `"torch_adam": true`), DeepSpeed refuses
      the fp32 states (an AssertionError naming FusedAdam, raised before anything moves);
      `STATES_ANY_OPTIMIZER` move instead, from then on.
    `offload` raises where nothing can move: parameters offloaded or no optimizer (DeepSpeed's
    AssertionError), or frozen parameters (NotImplementedError: DeepSpeed 0.19 would map them into a
    buffer that holds only the trainable ones). If a move fails part-way, what moved comes back first."""

    def __init__(self, engine):
        self.engine = engine
        self.include: list | None = None
        """The states asked for: None, every state DeepSpeed allows; else `STATES_ANY_OPTIMIZER`."""
        self.refusal = ""
        """Why DeepSpeed refused every state, when it did (its message)."""

    def offload(self) -> tuple[str, ...]:
        """Move the states to host memory; returns the names of those now there."""
        frozen = [name for name, parameter in self.engine.module.named_parameters() if not parameter.requires_grad]
        if frozen:
            raise NotImplementedError(f"DeepSpeed 0.19 cannot move the states of a model with frozen parameters "
                                      f"({len(frozen)}, e.g. {frozen[0]})")
        try:
            self._move()
        except BaseException:
            if self.offloaded():
                self.reload()
            raise
        return self.offloaded()

    def _move(self) -> None:
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

        try:
            self.engine.offload_states(include=self.include)
        except AssertionError as error:
            if self.include is not None or "FusedAdam" not in str(error) or self.offloaded():
                raise
            self.include = [OffloadStateTypeEnum(name) for name in STATES_ANY_OPTIMIZER]
            self.refusal = str(error)
            self.engine.offload_states(include=self.include)

    def offloaded(self) -> tuple[str, ...]:
        """Names of the states in host memory now."""
        return tuple(sorted(state.value for state in self.engine.optimizer.offloaded_states))

    def reload(self) -> None:
        """Bring every offloaded state back to the device."""
        self.engine.reload_states()
        if self.offloaded():
            raise RuntimeError(f"DeepSpeed left states in host memory after reload_states: {self.offloaded()}")
