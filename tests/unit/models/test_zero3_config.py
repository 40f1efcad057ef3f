"""The DeepSpeed JSON goes to deepspeed.initialize as written; trainer-owned settings are refused by name."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flexrl_ds.models.zero3 import check_ds_config

GOOD = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-6, "torch_adam": True}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}},
}


def _with(**changes):
    config = copy.deepcopy(GOOD)
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    return config


def test_a_complete_config_passes_unchanged():
    config = copy.deepcopy(GOOD)
    check_ds_config(config, world_size=4)
    check_ds_config(_with(train_batch_size=4), world_size=4)
    check_ds_config(_with(optimizer=None, scheduler=None), world_size=4, train=False)
    assert config == GOOD


@pytest.mark.parametrize("changes,world,train,key", [
    (dict(zero_optimization={"stage": 2}), 4, True, "zero_optimization.stage"),
    (dict(zero_optimization=None), 4, True, "zero_optimization.stage"),
    (dict(gradient_accumulation_steps=2), 4, True, "gradient_accumulation_steps"),
    (dict(train_batch_size=8), 4, True, "train_batch_size"),
    (dict(train_micro_batch_size_per_gpu=None), 4, True, "train_micro_batch_size_per_gpu"),
    (dict(sequence_parallel_size=2), 4, True, "sequence_parallel_size"),
    (dict(optimizer=None), 4, True, "optimizer"),
    (dict(flexrl={"sp": {}}), 4, True, "flexrl"),
])
def test_trainer_owned_settings_are_rejected_by_name(changes, world, train, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        check_ds_config(_with(**changes), world_size=world, train=train)


def test_keys_deepspeed_never_read_are_named_with_the_key_meant():
    """(DeepSpeed itself reading a config: tests/distributed/test_model_zero3.py.)"""
    from flexrl_ds.models.zero3 import AskedKeys, unread_keys_note

    config = AskedKeys({"gradient_clippping": 1.0, "bf16": {"enabled": True}, "my_notes": "x"})
    shallow = copy.copy(config)  # DeepSpeed reads from copies it makes: they share the record
    shallow.get("bf16")
    shallow.get("gradient_clipping")
    assert "steps_per_print" not in shallow
    assert config.asked == {"bf16", "gradient_clipping", "steps_per_print"}
    note = unread_keys_note(config, config.asked)
    assert note == ("DeepSpeed config: DeepSpeed did not read 'gradient_clippping' (did you mean "
                    "'gradient_clipping'?), 'my_notes': no effect on this run")
    assert unread_keys_note({"bf16": {}}, {"bf16", "fp16"}) is None
    saved = pickle.loads(pickle.dumps(config))  # as DeepSpeed's checkpoints hold it
    assert type(saved) is dict and saved == dict(config)


@pytest.mark.parametrize("block, name, said", [
    ("optimizer", "adamw_typo", "optimizer.type: DeepSpeed knows no optimizer 'adamw_typo' (did you mean 'AdamW'?)"),
    ("optimizer", "Adamm", "optimizer.type: DeepSpeed knows no optimizer 'Adamm' (did you mean 'Adam'?)"),
    ("scheduler", "WarmupLRR", "scheduler.type: DeepSpeed knows no scheduler 'WarmupLRR' (did you mean 'WarmupLR'?)"),
    ("scheduler", "zzz", "scheduler.type: DeepSpeed knows no scheduler 'zzz' (its own: "),
])
def test_names_deepspeed_would_refuse_in_the_ranks_are_refused_first(block, name, said):
    config = _with(**{block: {"type": name, "params": {}}})
    with pytest.raises(ValueError) as raised:
        check_ds_config(config, world_size=4)
    assert str(raised.value).startswith(said)


def _deepspeed_accepts_optimizer(name: str) -> bool:
    """DeepSpeed's own judgement: its config lowercases names of its own optimizers, then the engine
    asks `_is_supported_optimizer` (engine.py), which needs no engine."""
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    from deepspeed.runtime.engine import DeepSpeedEngine

    resolved = name.lower() if name.lower() in DEEPSPEED_OPTIMIZERS else name
    return DeepSpeedEngine._is_supported_optimizer(None, resolved)


def test_the_optimizer_check_agrees_with_deepspeed_on_every_name():
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    names = ([name for own in DEEPSPEED_OPTIMIZERS for name in (own, own.upper(), own.capitalize())]
             + [name for name in dir(torch.optim) if name[:1].isupper()] + ["adamw_typo", "SGDD", "Muon2", "lbfgs"])
    for name in names:
        config = _with(optimizer={"type": name, "params": {}})
        if _deepspeed_accepts_optimizer(name):
            check_ds_config(config, world_size=4)
        else:
            with pytest.raises(ValueError, match=f"optimizer.type: DeepSpeed knows no optimizer '{name}'"):
                check_ds_config(config, world_size=4)


def test_every_scheduler_deepspeed_or_torch_has_passes():
    from deepspeed.runtime import lr_schedules

    for name in list(lr_schedules.VALID_LR_SCHEDULES) + [n for n in dir(torch.optim.lr_scheduler) if n.endswith("LR")]:
        check_ds_config(_with(scheduler={"type": name, "params": {}}), world_size=4)
    with pytest.raises(ValueError, match=r"scheduler: expected an object with a 'type' and 'params', got 'WarmupLR'"):
        check_ds_config(_with(scheduler="WarmupLR"), world_size=4)


@pytest.mark.parametrize("changes, said", [
    (dict(train_micro_batch_size_per_gpu=2, train_batch_size=8),
     "train_micro_batch_size_per_gpu: the micro-batch must be 1, got 2: each rank takes one"),
    (dict(train_micro_batch_size_per_gpu=None, train_batch_size=8),
     "train_batch_size 8 over 4 ranks: the micro-batch must be 1, got 2: each rank takes one"),
])
def test_a_micro_batch_other_than_one_is_refused_as_without_effect(changes, said):
    with pytest.raises(ValueError) as raised:
        check_ds_config(_with(**changes), world_size=4)
    assert str(raised.value).startswith(said)
    check_ds_config(_with(train_micro_batch_size_per_gpu=None, train_batch_size=4), world_size=4)


def test_torch_names_are_checked_without_importing_deepspeed():
    """DeepSpeed's import warns on a driver without GPUs: the shipped configs' names need none of it."""
    code = ("import json, sys; from flexrl_ds.models.zero3 import check_ds_config; "
            "c = json.load(open('ds_configs/grpo_tiny_cpu.json')); c.pop('flexrl'); "
            "c['scheduler'] = {'type': 'StepLR', 'params': {}}; check_ds_config(c, 4); "
            "print('deepspeed' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[3], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "False"
