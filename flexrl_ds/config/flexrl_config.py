"""The `flexrl` section of a DeepSpeed JSON config, as typed dataclasses.

A run config is an ordinary DeepSpeed JSON file (ZeRO-3 etc.) with one extra top-level key,
`"flexrl"`, holding the sections below. `load_run_config(path)` splits the two: the DeepSpeed part
goes to `deepspeed.initialize` untouched, the `flexrl` part is validated here. Every section and
field is optional; defaults are those documented per field. Unknown keys and wrongly typed values
fail with a `ValueError` naming the dotted key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flexrl_ds.config.json_files import read_json
from flexrl_ds.config.typed import from_dict
from flexrl_ds.data.config import DataConfig
from flexrl_ds.rl.config import GRPOConfig


def _is_power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


@dataclass
class SPConfig:
    """FlexUlysses sequence-parallel planning (section `flexrl.sp`)."""

    p_max: int = 8
    """Largest Ulysses degree a sequence may get; a power of two, at most the SP domain size."""
    h_pack: int | None = None
    """Sequences shorter than this many tokens are packed together; None: the planner's default."""
    H_pack: int | None = None
    """Token budget of one pack of short sequences; None: the planner's default."""
    max_tokens_per_rank: int | None = None
    """Cap on the tokens one rank holds in a step (activation memory); None: no cap."""
    cost_model: str = "qwen2.5-vl-7b"
    """A preset name (qwen2.5-vl-7b, qwen2.5-vl-32b, mimo-vl-7b) or the path of a HF config.json."""
    calibration: str | None = None
    """Path of a calibration JSON written by `flexrl bench sp --calibrate`; None: formula defaults."""
    domain_size: int | None = None
    """Ranks of one sequence-parallel domain; None: the whole world. Must divide the world size."""
    overlap: bool = True
    """Overlap pack j+1's all-to-all with pack j's attention."""
    balance_vision: bool = True
    """Spread images/frames over the SP domain's ranks by patch count."""
    oversize: str = "error"
    """What to do with a sequence that cannot fit at p_max under the token cap: error|drop|truncate."""

    def __post_init__(self) -> None:
        if not _is_power_of_two(self.p_max):
            raise ValueError(f"flexrl.sp.p_max: {self.p_max} is not a power of two")
        for name in ("h_pack", "H_pack", "max_tokens_per_rank", "domain_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"flexrl.sp.{name}: must be positive, got {value}")
        if self.h_pack is not None and self.H_pack is not None and self.h_pack > self.H_pack:
            raise ValueError(f"flexrl.sp.h_pack ({self.h_pack}) exceeds flexrl.sp.H_pack ({self.H_pack})")
        if self.oversize not in ("error", "drop", "truncate"):
            raise ValueError(f"flexrl.sp.oversize: {self.oversize!r} is not one of error, drop, truncate")


@dataclass
class FlexRLConfig:
    """Everything under the `flexrl` key of a run config."""

    sp: SPConfig = field(default_factory=SPConfig)
    """FlexUlysses planning and execution."""
    data: DataConfig = field(default_factory=DataConfig)
    """ShadowLoader data settings (flexrl_ds/data/config.py)."""
    rl: GRPOConfig = field(default_factory=GRPOConfig)
    """GRPO advantage and loss settings (flexrl_ds/rl/config.py)."""


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
