"""--resume with a config other than the checkpoint's says what changed; --out that is a file is refused."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest

from flexrl_ds.trainer.checkpoint import changed_settings, check_out_dir, resume_config_note

CONFIG = json.loads((Path(__file__).parents[3] / "ds_configs" / "grpo_tiny_cpu.json").read_text())


def _leaves(config: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in config.items():
        dotted = f"{prefix}.{key}" if prefix else key
        out += _leaves(value, dotted) if isinstance(value, dict) and value else [dotted]
    return out


def _set(config: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    for key in parents:
        config = config[key]
    config[last] = value


@pytest.mark.parametrize("seed", range(5))
def test_the_changed_keys_are_exactly_those_changed(seed):
    rng = random.Random(seed)
    changed = sorted(rng.sample(_leaves(CONFIG), 3))
    now = copy.deepcopy(CONFIG)
    for key in changed:
        _set(now, key, "other")
    said = changed_settings(CONFIG, now)
    assert [change.split(" (")[0] for change in said] == sorted(changed, key=lambda k: k.split("."))
    assert all(change.endswith('-> "other")') for change in said)


def test_keys_only_one_side_has_read_unset():
    now = copy.deepcopy(CONFIG)
    del now["gradient_clipping"]
    now["flexrl"]["trainer"]["profile_step"] = 3
    assert changed_settings(CONFIG, now) == ["flexrl.trainer.profile_step ((unset) -> 3)",
                                            "gradient_clipping (1.0 -> (unset))"]


def test_more_steps_alone_is_no_change_worth_a_note():
    now = copy.deepcopy(CONFIG)
    now["flexrl"]["trainer"]["max_steps"] = 500
    assert resume_config_note(CONFIG, now) == ""
    assert resume_config_note(CONFIG, copy.deepcopy(CONFIG)) == ""


def test_a_changed_batch_is_named_with_both_values():
    now = copy.deepcopy(CONFIG)
    now["flexrl"]["data"]["loader"]["global_batch"] = 2
    now["flexrl"]["trainer"]["max_steps"] = 500
    note = resume_config_note(CONFIG, now)
    assert "flexrl.data.loader.global_batch (4 -> 2)" in note and "max_steps" not in note
    assert "will not reproduce the uninterrupted run" in note


@pytest.mark.parametrize("resume", [False, True])
def test_an_out_that_is_a_file_is_refused(tmp_path, resume):
    out = tmp_path / "train.jsonl"
    out.write_text("{}\n")
    with pytest.raises(ValueError, match=r"train.jsonl: is a file; --out names the run's folder"):
        check_out_dir(out, resume)
    assert out.read_text() == "{}\n"


def test_optimizer_changes_are_said_to_be_restored_from_the_checkpoint():
    now = copy.deepcopy(CONFIG)
    now["optimizer"]["params"]["lr"] = 1e-5
    note = resume_config_note(CONFIG, now)
    assert note.startswith("--resume: changed since the checkpoint: optimizer.params.lr (0.01 -> 1e-05). DeepSpeed "
                           "restores the optimizer's and scheduler's state")
    assert "goes on with the new values" not in note
    now["flexrl"]["rl"]["init_kl_coef"] = 0.5
    first, second = resume_config_note(CONFIG, now).split("\n")
    assert "flexrl.rl.init_kl_coef (0.001 -> 0.5)" in first and "goes on with the new values" in first
    assert "optimizer.params.lr" in second and "init_kl_coef" not in second
