"""The `flexrl` section of a DeepSpeed JSON config, as typed dataclasses.

A run config is an ordinary DeepSpeed JSON file (ZeRO-3 etc.) with one extra top-level key,
`"flexrl"`, holding the sections below. `load_run_config(path)` splits the two: the DeepSpeed part
goes to `deepspeed.initialize` untouched, the `flexrl` part is validated here. Every section and
field is optional when loading; defaults are those documented per field. Unknown keys and wrongly
typed values fail with a `ValueError` naming the dotted key. `flexrl train` checks more across
sections before it starts (trainer/validation.py), e.g. `sp.p_max` at most the SP domain's ranks and
`data.loader.num_samples_per_prompt` at least 2 (the GRPO group); the defaults (p_max 8 over 2
ranks, 1 sample per prompt) do not pass them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flexrl_ds.common.json_files import read_json
from flexrl_ds.common.overrides import apply_overrides
from flexrl_ds.common.typed import from_dict
from flexrl_ds.loader.config import DataConfig
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.rl.config import GRPOConfig
from flexrl_ds.rollout.config import RolloutConfig
from flexrl_ds.trainer.config import TrainerConfig


@dataclass
class FlexRLConfig:
    """Everything under the `flexrl` key of a run config."""

    sp: SPConfig = field(default_factory=SPConfig)
    """FlexUlysses planning and execution."""
    data: DataConfig = field(default_factory=DataConfig)
    """ShadowLoader data settings: media (flexrl_ds/media/config.py), loader and pool
    (flexrl_ds/loader/config.py)."""
    rl: GRPOConfig = field(default_factory=GRPOConfig)
    """GRPO advantage and loss settings (flexrl_ds/rl/config.py)."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout engines and sampling (flexrl_ds/rollout/config.py)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """GRPO trainer: ranks, seed, steps, checkpoints (flexrl_ds/trainer/config.py)."""


@dataclass
class RunConfig:
    """A DeepSpeed config split into the part DeepSpeed reads and the `flexrl` part."""

    deepspeed: dict[str, Any]
    flexrl: FlexRLConfig
    source: str


def parse_run_config(raw: dict[str, Any], source: str = "<dict>") -> RunConfig:
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: a run config must be a JSON object")
    deepspeed_part = {key: value for key, value in raw.items() if key != "flexrl"}
    try:
        flexrl = from_dict(FlexRLConfig, raw.get("flexrl", {}), where="flexrl")
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    return RunConfig(deepspeed=deepspeed_part, flexrl=flexrl, source=source)


def load_run_config(path: str | Path) -> RunConfig:
    """Read a DeepSpeed JSON config with a `flexrl` section and validate the latter."""
    return parse_run_config(read_json(path, "config file"), source=str(path))


def effective_run_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[RunConfig, dict]:
    """(validated run config, its JSON) of the file at `path` with the `--set` `overrides` applied."""
    raw = apply_overrides(read_json(path, "config file"), overrides)
    source = str(path) + (f" with --set {' '.join(overrides)}" if overrides else "")
    return parse_run_config(raw, source=source), raw
