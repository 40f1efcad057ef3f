"""The DeepSpeed JSON goes to deepspeed.initialize as written; trainer-owned settings are refused by name."""

from __future__ import annotations

import copy
import pickle

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


@pytest.mark.parametrize("block, name", [("optimizer", "AdamW"), ("optimizer", "adam"), ("optimizer", "SGD"),
                                         ("scheduler", "WarmupCosineLR"), ("scheduler", "StepLR")])
def test_names_deepspeed_knows_pass(block, name):
    """DeepSpeed's own reference: its config module's optimizer list, its schedules, and torch.optim."""
    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    known = (name.lower() in DEEPSPEED_OPTIMIZERS or hasattr(torch.optim, name) if block == "optimizer"
             else hasattr(lr_schedules, name) or hasattr(torch.optim.lr_scheduler, name))
    assert known
    check_ds_config(_with(**{block: {"type": name, "params": {}}}), world_size=4)


def test_a_micro_batch_other_than_one_is_refused_as_without_effect():
    with pytest.raises(ValueError, match=r"train_micro_batch_size_per_gpu: must be 1, got 2: each rank takes one"):
        check_ds_config(_with(train_micro_batch_size_per_gpu=2, train_batch_size=8), world_size=4)
