"""Cost model of one sequence for FlexUlysses planning (pure: no torch, no distributed runtime).

For a sequence of `L` tokens sharded over `d` ranks, each rank's LLM work is `(L² + c·L) / d`
(docs/PLAN_SCHEMA.md): `L²` is causal attention, `c·L` the linear layers, with `c = P / h`, `P` the
parameters of one decoder layer (q/k/v/o projections + gated MLP) and `h` the hidden size.
Activation memory is proportional to the tokens a rank holds (`L / d`); the vision tower's cost to
the patches it encodes (4 patches per merged vision token for a 2×2 spatial merge).

Where the constants come from: a preset (`qwen2.5-vl-7b`, `qwen2.5-vl-32b`, `mimo-vl-7b`) or a
Hugging Face `config.json` (text fields may sit under `text_config`, as in Qwen2.5-VL).

Calibration file (optional, JSON, written by measurements on the real hardware):
```json
{
  "attention_s_per_token2": 3.1e-13,   # seconds per L² unit of causal attention (whole model)
  "linear_s_per_token": 2.0e-8,        # seconds per token of the linear layers (whole model)
  "all_to_all": {                      # per group size: latency and bandwidth of one all-to-all
    "2": {"latency_s": 2e-5, "bytes_per_s": 1.5e11},
    "8": {"latency_s": 4e-5, "bytes_per_s": 1.2e11}
  },
  "bytes_per_token": 7168              # bytes one token carries through one all-to-all (q, k or v)
}
```
With a calibration, `c` becomes the measured `linear_s_per_token / attention_s_per_token2` and
`seconds()` converts a cost into seconds; all keys are optional except the first two.

Files written since the step-time objective (planning/step_time.py) also keep all three fitted
attention terms and the linear constant per layer, and say what hardware and model they fit:
`"attention_fit_s": {"a", "b", "c"}`, `"linear_fit_s": {"s", "c"}`, `"num_layers"`,
`"device_name"`, `"model_shapes"`, per all-to-all size `"source": "measured" | "assumed"`, and
`"network": {"gpus_per_node", "latency_s", "bytes_per_s", "source"}`. Then `c = (b + s) / a`
(the calibrated cost of a sequence is a·L² + (b + s)·L per layer, plus per-pack floors) and the
planner minimises the modelled step time. `load_cost_model(model, "auto", device_name=...)`
picks the shipped file (ds_configs/calibration/) whose device and model shapes match, if any.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from flexrl_ds.common.json_files import read_json
from flexrl_ds.planning.step_time import Link, StepTimeModel

SHIPPED_CALIBRATIONS = Path(__file__).resolve().parents[2] / "ds_configs" / "calibration"
"""Calibration files shipped with the repository (`calibration="auto"` looks here)."""


@dataclass(frozen=True)
class LayerShapes:
    """Shapes of one decoder layer of the language model (what `c` and the head rules need)."""

    hidden_size: int
    """h: width of the residual stream."""
    intermediate_size: int
    """Width of the gated MLP (gate, up and down projections)."""
    num_heads: int
    """Query attention heads; Ulysses scatters these over the group."""
    num_kv_heads: int
    """Key/value heads (GQA); replicated when fewer than the group size."""
    head_dim: int
    """Width of one head."""
    num_layers: int
    """Decoder layers (scales seconds, not the relative cost)."""

    def params_per_layer(self) -> int:
        """P: q and o projections (h·H·hd each), k and v (h·KV·hd each), MLP (3·h·I); biases ignored."""
        attention = 2 * self.hidden_size * self.num_heads * self.head_dim
        attention += 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return attention + 3 * self.hidden_size * self.intermediate_size


# Text-model shapes of the presets, from the models' published config.json files:
#   Qwen2.5-VL-7B-Instruct:  hidden 3584, intermediate 18944, 28 heads, 4 KV heads, 28 layers (c ≈ 65,024)
#   Qwen2.5-VL-32B-Instruct: hidden 5120, intermediate 27648, 40 heads, 8 KV heads, 64 layers (c ≈ 95,232)
#   MiMo-VL-7B (MiMo-7B LLM): hidden 4096, intermediate 11008, 32 heads, 8 KV heads, 36 layers (c ≈ 43,264)
PRESETS: dict[str, LayerShapes] = {
    "qwen2.5-vl-7b": LayerShapes(3584, 18944, 28, 4, 128, 28),
    "qwen2.5-vl-32b": LayerShapes(5120, 27648, 40, 8, 128, 64),
    "mimo-vl-7b": LayerShapes(4096, 11008, 32, 8, 128, 36),
}

PATCHES_PER_VISION_TOKEN = 4
"""Qwen2.5-VL (14 px patches) and Qwen3-VL (16 px) merge 2×2 patches into one LLM token."""


@dataclass(frozen=True)
class Calibration:
    """Measured constants that turn relative costs into seconds (see the module docstring)."""

    attention_s_per_token2: float
    """Seconds per unit of L² (causal attention over all layers)."""
    linear_s_per_token: float
    """Seconds per token of the linear layers over all layers."""
    all_to_all: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Group size -> (latency seconds, bytes per second) of one all-to-all."""
    bytes_per_token: int = 0
    """Bytes one token carries through one all-to-all; 0 means unknown (no comm seconds)."""
    step: StepTimeModel | None = None
    """The step-time model (three-term attention fit, links); None for files without the fits."""
    source: str = ""
    """Path of the file it was read from."""


@dataclass(frozen=True)
class CostModel:
    """Per-sequence cost `L² + c·L`, memory `L`, vision cost `patches`; head counts for the degree rule."""

    name: str
    """Preset name or config path the model came from."""
    shapes: LayerShapes
    """Decoder-layer shapes."""
    c: float
    """Linear-layer coefficient: cost(L) = L² + c·L (P/h, or the calibrated ratio)."""
    calibration: Calibration | None = None
    """Measured constants, when a calibration file was given."""

    @property
    def num_heads(self) -> int:
        return self.shapes.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.shapes.num_kv_heads

    def cost(self, tokens: float) -> float:
        """LLM cost of a whole sequence (all of it on one rank)."""
        return float(tokens) * tokens + self.c * tokens

    def attention(self, tokens: float) -> float:
        return float(tokens) * tokens

    def vision_cost(self, vision_tokens: int) -> int:
        """Vision-tower cost in patches (independent of text length)."""
        return PATCHES_PER_VISION_TOKEN * vision_tokens

    @property
    def step(self) -> StepTimeModel | None:
        """The calibrated step-time model, if the calibration has one."""
        return self.calibration.step if self.calibration is not None else None

    def seconds(self, cost: float) -> float | None:
        """Cost units -> seconds with the calibration (None without one)."""
        if self.calibration is None:
            return None
        if self.step is not None:
            return cost * self.step.attention_fit[0] * self.step.num_layers
        return cost * self.calibration.attention_s_per_token2

    def all_to_all_seconds(self, tokens: float, degree: int) -> float | None:
        """Seconds of a pack's all-to-alls (all layers, fwd+bwd, with the step model; one
        all-to-all with an older file) moving `tokens` tokens in a group of `degree` (None if unknown)."""
        if self.step is not None:
            return float(self.step.all_to_all_s(tokens, degree, self.num_heads, self.num_kv_heads,
                                                self.shapes.head_dim))
        cal = self.calibration
        if cal is None or degree <= 1 or degree not in cal.all_to_all or not cal.bytes_per_token:
            return None if degree > 1 else 0.0
        latency, bandwidth = cal.all_to_all[degree]
        return latency + tokens * (degree - 1) / degree * cal.bytes_per_token / bandwidth


def shapes_from_config(raw: Mapping[str, Any], source: str) -> LayerShapes:
    """Read text-model shapes from a HF config dict (top level or under `text_config`)."""
    text = raw.get("text_config") or {}
    merged = {**raw, **text} if isinstance(text, dict) else dict(raw)

    def need(key: str) -> int:
        value = merged.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{source}: model config field {key!r} must be a positive integer, got {value!r}")
        return value

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    kv_heads = merged.get("num_key_value_heads") or heads
    head_dim = merged.get("head_dim") or hidden // heads
    return LayerShapes(hidden, active_intermediate_size(merged, need), heads, int(kv_heads), int(head_dim),
                       need("num_hidden_layers"))


def active_intermediate_size(fields: Mapping[str, Any], need=None) -> int:
    """The MLP width a token runs through: `intermediate_size`, or for a sparse MoE (`num_experts`)
    its active experts' `moe_intermediate_size` x `num_experts_per_tok` (every layer sparse; the
    router's h x experts matmul left out): active-parameter FLOPs."""
    need = need or (lambda key: int(fields[key]))
    if fields.get("num_experts") and fields.get("num_experts_per_tok"):
        return need("moe_intermediate_size") * need("num_experts_per_tok")
    return need("intermediate_size")


def load_calibration(path: str | Path) -> Calibration:
    path = Path(path)
    raw = read_json(path, "calibration file")
    try:
        attention, linear = float(raw["attention_s_per_token2"]), float(raw["linear_s_per_token"])
        table = {int(k): (float(v["latency_s"]), float(v["bytes_per_s"]))
                 for k, v in (raw.get("all_to_all") or {}).items()}
        bytes_per_token = int(raw.get("bytes_per_token", 0))
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"{path}: malformed calibration ({type(error).__name__}: {error})") from None
    if attention <= 0 or linear <= 0:
        raise ValueError(f"{path}: attention_s_per_token2 and linear_s_per_token must be positive")
    return Calibration(attention, linear, table, bytes_per_token, _step_model(raw, path), str(path))


def _step_model(raw: Mapping[str, Any], path: Path) -> StepTimeModel | None:
    """The step-time model of a file with the per-layer fits; None for older files."""
    if "attention_fit_s" not in raw:
        return None
    try:
        fit, linear = raw["attention_fit_s"], raw["linear_fit_s"]
        links = {int(k): Link(float(v["latency_s"]), float(v["bytes_per_s"]), v.get("source", "measured") == "measured")
                 for k, v in (raw.get("all_to_all") or {}).items()}
        net = raw.get("network")
        network = None if net is None else Link(float(net["latency_s"]), float(net["bytes_per_s"]),
                                                net.get("source", "measured") == "measured")
        model = StepTimeModel((float(fit["a"]), float(fit["b"]), float(fit["c"])),
                              (float(linear["s"]), float(linear["c"])), int(raw["num_layers"]), links,
                              int((net or {}).get("gpus_per_node", 8)), network, int(raw.get("bytes_per_element", 2)))
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"{path}: malformed step-time fits ({type(error).__name__}: {error})") from None
    if min(model.attention_fit + model.linear_fit) < 0 or model.attention_fit[0] <= 0 or model.linear_fit[0] <= 0:
        raise ValueError(f"{path}: attention_fit_s / linear_fit_s terms must be non-negative (a, s positive)")
    return model


def shipped_calibration(shapes: LayerShapes, device_name: str | None) -> Path | None:
    """The shipped calibration whose device and model shapes match (None: no accelerator named, or
    no file for it)."""
    if not device_name:
        return None
    wanted = {"hidden_size": shapes.hidden_size, "intermediate_size": shapes.intermediate_size,
              "num_heads": shapes.num_heads, "num_kv_heads": shapes.num_kv_heads, "head_dim": shapes.head_dim}
    for path in sorted(SHIPPED_CALIBRATIONS.glob("*.json")):
        raw = read_json(path, "calibration file")
        if str(raw.get("device_name", "")).strip().lower() == device_name.strip().lower() \
                and raw.get("model_shapes") == wanted:
            return path
    return None


def load_cost_model(model: str, calibration: str | Path | None = None, device_name: str | None = None) -> CostModel:
    """A preset name, a model directory, or a config.json path -> CostModel. `calibration`: a
    file, None (the FLOP formula), or "auto": the shipped file matching `device_name` and the
    model's shapes, else the formula."""
    if model in PRESETS:
        shapes = PRESETS[model]
    else:
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"model {model!r}: not a preset ({', '.join(PRESETS)}) and no config.json at {path}")
        shapes = shapes_from_config(read_json(path, "model config"), str(path))
    cost = CostModel(name=model, shapes=shapes, c=shapes.params_per_layer() / shapes.hidden_size)
    if calibration == "none":
        calibration = None
    if calibration == "auto":
        calibration = shipped_calibration(shapes, device_name)
    if calibration is not None:
        cal = load_calibration(calibration)
        c = cal.linear_s_per_token / cal.attention_s_per_token2
        if cal.step is not None:
            (a, b, _), (s, _) = cal.step.attention_fit, cal.step.linear_fit
            c = (b + s) / a
        cost = replace(cost, c=c, calibration=cal)
    return cost
