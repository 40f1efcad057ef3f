"""A rollout backend is its engine module, its options module and one registry line
(rollout/base.py `ROLLOUT_BACKENDS`): a backend registered here, in a test, runs through the run's
config, checks and engine host without a change anywhere else, and no module outside a backend's own
asks which backend runs."""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from flexrl_ds.common.typed import from_dict
from flexrl_ds.rollout.base import (ROLLOUT_BACKENDS, BackendOptions, RolloutBackend, RolloutRequest, RolloutResult,
                                    SamplingParams, check_sleep_level, engine_class, options_class)
from flexrl_ds.rollout.config import RolloutConfig

PACKAGE = Path(__file__).resolve().parents[3] / "flexrl_ds"


@dataclass
class EchoOptions(BackendOptions):
    """A test backend's options: a GPU backend whose engines echo the prompt, `repeat` times."""

    needs_gpu: ClassVar[bool] = True
    repeat: int = 1
    """How often the engine repeats the prompt."""
    sleep_level: int = 1
    """As every backend's."""

    def __post_init__(self) -> None:
        check_sleep_level("echo", self.sleep_level)

    def engine_options(self, rollout: RolloutConfig, skip_weights: bool) -> dict[str, Any]:
        return {"repeat": self.repeat, "load_weights": not skip_weights}

    def check_placement(self, rollout: RolloutConfig, colocated: bool) -> None:
        if colocated:
            raise ValueError("flexrl.rollout.backend 'echo': its engines run in actors of their own "
                             "(flexrl.trainer.colocate false)")


class EchoEngine:
    """Responds with the prompt's tokens, `repeat` times."""

    def __init__(self, model_dir: str, dtype: str, device: Any, max_batch_sequences: int, repeat: int,
                 load_weights: bool):
        self.repeat, self.load_weights = repeat, load_weights

    def generate(self, requests, params: SamplingParams) -> list[RolloutResult]:
        return [RolloutResult(request.sample_key, request.prompt_ids * self.repeat,
                              [0.0] * len(request.prompt_ids) * self.repeat, "length") for request in requests]


@pytest.fixture
def echo(monkeypatch):
    """The echo backend, registered for this test only."""
    monkeypatch.setitem(ROLLOUT_BACKENDS, "echo", RolloutBackend(f"{__name__}:EchoEngine", f"{__name__}:EchoOptions"))
    return "echo"


def test_a_registered_backend_is_accepted_by_the_config_and_builds_its_engine(echo):
    config = from_dict(RolloutConfig, {"backend": echo, "temperature": 0.7}, where="flexrl.rollout")
    assert options_class(echo) is EchoOptions and config.options == EchoOptions()
    assert engine_class(echo) is EchoEngine
    # its options decide the engine's keywords and the weights at start: at sleep level 1 nothing is dropped
    assert config.engine_options(colocated=True) == {"repeat": 1, "load_weights": True}
    assert not config.engines_start_without_policy_weights(colocated=True)
    assert config.logprob_diff_caveat() is None  # the default: no caveat

    from flexrl_ds.trainer.rollout_host import RolloutHost

    host = RolloutHost(echo, "unused", pixels=None, device="cpu", engine_options=config.engine_options(colocated=False))
    request = RolloutRequest("a/0", [5, 6, 7])
    assert host.engine.generate([request], SamplingParams())[0].response_ids == [5, 6, 7]


def test_the_trainers_checks_ask_the_backends_options(echo, monkeypatch):
    from flexrl_ds.trainer import validation

    rollout = RolloutConfig(backend=echo)
    assert validation.resolve_media_limits(rollout, records=[]) is rollout  # nothing to derive from records
    validation.check_engine_placement(SimpleNamespace(rollout=rollout, trainer=SimpleNamespace(colocate=False)))
    with pytest.raises(ValueError, match="'echo': its engines run in actors of their own"):
        validation.check_engine_placement(SimpleNamespace(rollout=rollout, trainer=SimpleNamespace(colocate=True)))
    monkeypatch.setattr(validation.device_mod, "detect", lambda: SimpleNamespace(is_gpu=False))
    monkeypatch.setattr(validation, "check_model_dir", lambda model_dir: None)
    monkeypatch.setattr(validation, "check_batch", lambda flexrl, num_ranks: None)
    monkeypatch.setattr(validation, "check_ds_config", lambda *args, **kwargs: None)
    run = SimpleNamespace(flexrl=SimpleNamespace(rollout=RolloutConfig(backend=echo), trainer=SimpleNamespace(
        colocate=False)), deepspeed={})
    with pytest.raises(ValueError, match="flexrl.rollout.backend 'echo' needs GPUs; this machine has none"):
        validation.check_run(run, "unused", num_ranks=1)


def test_an_unregistered_backend_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="flexrl.rollout.backend: 'echo' is not one of hf, vllm"):
        RolloutConfig(backend="echo")


def test_changed_options_of_a_backend_with_a_section_replace_that_section():
    config = RolloutConfig(backend="vllm")
    resolved = config.with_options(dataclasses.replace(config.vllm, max_images_per_prompt=3))
    assert resolved.vllm.max_images_per_prompt == 3 and config.vllm.max_images_per_prompt is None


def _backend_comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing something named `backend` with a registered backend's name."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        named = any(isinstance(side, (ast.Name, ast.Attribute)) and (getattr(side, "id", None) == "backend"
                                                                       or getattr(side, "attr", None) == "backend")
                    for side in sides)
        if named and any(isinstance(side, ast.Constant) and side.value in ROLLOUT_BACKENDS for side in sides):
            lines.append(node.lineno)
    return lines


def test_no_module_outside_a_backends_own_compares_the_backend_name():
    own = {name: f"rollout/{name}_" for name in ROLLOUT_BACKENDS}  # rollout/hf_engine.py, rollout/vllm_options.py...
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if any(relative.startswith(prefix) for prefix in own.values()):
            continue
        offenders += [f"{relative}:{line}" for line in _backend_comparisons(ast.parse(path.read_text()))]
    assert not offenders, "ask the backend's options (RolloutConfig.options) instead:\n" + "\n".join(offenders)
    assert _backend_comparisons(ast.parse('if run.flexrl.rollout.backend == "vllm": pass')) == [1]
