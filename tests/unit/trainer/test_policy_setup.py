"""launch.policy_setup: the run config's trainer settings reach every policy rank's PolicySetup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexrl_ds.config.flexrl_config import parse_run_config
from flexrl_ds.trainer.launch import policy_ranks, policy_setup

CONFIG = Path(__file__).resolve().parents[3] / "ds_configs" / "grpo_tiny_cpu.json"


def setup_with_trainer_setting(key: str, value):
    """The PolicySetup of the tiny config with `flexrl.trainer.<key>` set to value (None: left out)."""
    raw = json.loads(CONFIG.read_text())
    if value is not None:
        raw["flexrl"]["trainer"][key] = value
    return policy_setup(parse_run_config(raw), "model-dir", pixels=None, colocated=True)


@pytest.mark.parametrize("checkpointing", [None, False, True])
def test_activation_checkpointing_reaches_the_policy_setup(checkpointing):
    setup = setup_with_trainer_setting("activation_checkpointing", checkpointing)
    assert setup.activation_checkpointing is bool(checkpointing)


@pytest.mark.parametrize("offload", [None, False, True])
def test_offload_states_in_rollout_reaches_the_policy_ranks(offload):
    """The setting reaches PolicySetup, and from it what a rank builds to move its states for a rollout."""
    from flexrl_ds.models.zero3 import RolloutOffload
    from flexrl_ds.trainer.policy_worker import rollout_offload

    setup = setup_with_trainer_setting("offload_states_in_rollout", offload)
    assert setup.offload_states_in_rollout is (offload is not False)  # default: on
    engine = object()
    mover = rollout_offload(engine, setup)
    if offload is False:
        assert mover is None
    else:
        assert isinstance(mover, RolloutOffload) and mover.engine is engine


@pytest.mark.parametrize("backend, sleep_level, expected", [
    ("hf", None, {"load_weights_at_start": False}),  # hf's default level 2
    ("hf", 1, {"load_weights_at_start": True}),
    ("vllm", 2, {"load_format": "dummy"}),
    ("vllm", None, {"load_format": "auto"}),  # vllm's default level 1
])
def test_colocated_engines_that_free_their_weights_at_once_start_without_reading_them(backend, sleep_level, expected):
    """The policy ranks build their colocated engine from PolicySetup.rollout_options: at sleep_level 2
    (freed at its first sleep) it starts without the model directory's weights, and the trainer
    syncs every weight before step 0 (launch.drive); ranks without an engine get no options."""
    raw = json.loads(CONFIG.read_text())
    raw["flexrl"]["rollout"]["backend"] = backend
    if sleep_level is not None:
        raw["flexrl"]["rollout"][backend] = {"sleep_level": sleep_level}
    run = parse_run_config(raw)
    options = policy_setup(run, "model-dir", pixels=None, colocated=True).rollout_options
    assert {key: options[key] for key in expected} == expected
    if expected in ({"load_weights_at_start": False}, {"load_format": "dummy"}):
        assert run.flexrl.rollout.engines_start_without_policy_weights(colocated=True)
    assert policy_setup(run, "model-dir", pixels=None, colocated=False).rollout_options == {}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampling_temperature_reaches_the_policy_log_probs(temperature):
    """The policy's and the reference's log-probs are taken at the run's sampling temperature
    (PolicyWorker builds both engines with it: tests/unit/models/test_flex_model.py checks the values)."""
    raw = json.loads(CONFIG.read_text())
    raw["flexrl"]["rollout"]["temperature"] = temperature
    assert policy_setup(parse_run_config(raw), "model-dir", pixels=None, colocated=True).logprob_temperature == temperature


def test_policy_worker_builds_both_engines_at_the_sampling_temperature(monkeypatch):
    """PolicyWorker hands PolicySetup.logprob_temperature to the policy's and the reference's engine
    (stand-ins for the model loading and DeepSpeed record what it passes)."""
    from types import SimpleNamespace

    from flexrl_ds.trainer import policy_worker

    built = []
    monkeypatch.setattr(policy_worker, "load_model", lambda model_dir, dtype: SimpleNamespace(config=None))
    monkeypatch.setattr(policy_worker.zero3, "build_engine", lambda model, ds_config, **options: built.append(options))
    raw = json.loads(CONFIG.read_text())
    raw["flexrl"]["rollout"]["temperature"] = 0.7
    worker = policy_worker.PolicyWorker.__new__(policy_worker.PolicyWorker)
    worker.setup = policy_setup(parse_run_config(raw), "model-dir", pixels=None, colocated=True)
    worker.device, worker.tree = None, SimpleNamespace(domain_group=None)
    worker._engine(train=True)
    worker._engine(train=False)
    assert [options["temperature"] for options in built] == [0.7, 0.7]


@pytest.mark.parametrize("leaf_layers", [None, False, True])
def test_zero3_leaf_layers_reach_both_engines(monkeypatch, leaf_layers):
    """`flexrl.trainer.zero3_leaf_layers` (default on) reaches the policy's and the reference's engines."""
    from types import SimpleNamespace

    from flexrl_ds.trainer import policy_worker

    built = []
    monkeypatch.setattr(policy_worker, "load_model", lambda model_dir, dtype: SimpleNamespace(config=None))
    monkeypatch.setattr(policy_worker.zero3, "build_engine", lambda model, ds_config, **options: built.append(options))
    worker = policy_worker.PolicyWorker.__new__(policy_worker.PolicyWorker)
    worker.setup = setup_with_trainer_setting("zero3_leaf_layers", leaf_layers)
    worker.device, worker.tree = None, SimpleNamespace(domain_group=None)
    worker._engine(train=True)
    worker._engine(train=False)
    assert [options["leaf_layers"] for options in built] == [leaf_layers is not False] * 2


@pytest.mark.parametrize("attention", [None, "varlen", "sdpa"])
def test_vision_attention_reaches_the_policy_setup(attention):
    assert setup_with_trainer_setting("vision_attention", attention).vision_attention == (attention or "varlen")


def test_an_unknown_vision_attention_is_refused():
    with pytest.raises(ValueError, match="flexrl.trainer.vision_attention: one of varlen, sdpa, got 'flash'"):
        setup_with_trainer_setting("vision_attention", "flash")


def test_the_ready_line_counts_ranks_in_words():
    assert [policy_ranks(n) for n in (1, 2, 64)] == ["1 policy rank", "2 policy ranks", "64 policy ranks"]
