"""`flexrl train --set KEY.PATH=VALUE`: overrides applied over the config file, validated like it."""

from __future__ import annotations

import json

import pytest

from flexrl_ds.common.overrides import apply_overrides
from flexrl_ds.config.flexrl_config import effective_run_config, load_run_config

RAW = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-5}}, "flexrl": {"rl": {"init_kl_coef": 0.0}}}


def test_values_are_read_as_json_else_as_strings_and_paths_are_created():
    out = apply_overrides(RAW, ["flexrl.rl.init_kl_coef=0.01", "optimizer.params.lr=1e-6",
                                "flexrl.rl.kl_estimator=k2", "flexrl.rl.dual_clip=null",
                                "scheduler.params={\"warmup_num_steps\": 3}", "flexrl.trainer.save_last=false"])
    assert out["flexrl"]["rl"] == {"init_kl_coef": 0.01, "kl_estimator": "k2", "dual_clip": None}
    assert out["optimizer"]["params"]["lr"] == 1e-6 and out["scheduler"] == {"params": {"warmup_num_steps": 3}}
    assert out["flexrl"]["trainer"] == {"save_last": False}
    assert RAW["optimizer"]["params"]["lr"] == 1e-5  # the input is not changed
    assert apply_overrides(RAW, ["a.b=x=y"])["a"]["b"] == "x=y"  # the first '=' splits


@pytest.mark.parametrize("override, message", [
    ("flexrl.rl.init_kl_coef", "expected KEY.PATH=VALUE"),
    ("flexrl..rl=1", "expected KEY.PATH=VALUE"),
    ("optimizer.type.x=1", "optimizer.type is not an object"),
])
def test_malformed_overrides_are_refused(override, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides(RAW, [override])


def test_the_flexrl_part_is_validated_like_the_file(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps(RAW))
    run, raw = effective_run_config(path, ["flexrl.rl.init_kl_coef=0.05", "flexrl.rl.loss_reduction=sequence_mean"])
    assert run.flexrl.rl.init_kl_coef == 0.05 and run.flexrl.rl.loss_reduction == "sequence_mean"
    assert raw["flexrl"]["rl"]["init_kl_coef"] == 0.05
    file_run = load_run_config(path)
    assert file_run.flexrl.rl.init_kl_coef == 0.0 and effective_run_config(path)[0] == file_run
    for bad, key in (("flexrl.rl.init_kl_coef=\"high\"", "flexrl.rl.init_kl_coef"),
                     ("flexrl.rl.no_such_key=1", "no_such_key"), ("flexrl.rl.kl_estimator=k9", "kl_estimator")):
        with pytest.raises(ValueError, match=key) as error:
            effective_run_config(path, [bad])
        assert "with --set" in str(error.value)
