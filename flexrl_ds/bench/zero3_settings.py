"""ZeRO-3 settings that cut per-module host work, read against a model's module tree (no engine).

DeepSpeed 0.19.8's knobs, as its source applies them (runtime/zero/parameter_offload.py):

- `stage3_param_persistence_threshold` T: every parameter of at most T elements is *persistent*
  (`mark_persistent_parameters`, in module order, until `stage3_model_persistence_threshold`
  elements are persistent): kept whole on every rank from its first gather on, never released, its
  partition on the device even under `offload_param`. Hooks still run for its module.
- `stage3_module_granularity_threshold` G: a module's granularity is its parameters' elements
  (its own and its descendants') over its "layers" (its torch-leaf descendants with parameters, its
  non-container descendants with parameters, and itself); containers (`ModuleList`, `Sequential`,
  ...) and modules over `Z3_MAX_LEAF_SIZE` elements never qualify, nor does a torch leaf. Walking
  from the root, parents first, a module of granularity <= G becomes a ZeRO-3 *leaf*: its hooks
  gather all its descendants' parameters at once, and its descendants get no hooks of their own.
- `stage3_prefetch_bucket_size`, `stage3_max_live_parameters`, `stage3_max_reuse_distance`: element
  volumes (prefetch ahead along the recorded trace; the cap on gathered elements; keep a released
  parameter gathered if it is used again within this many elements of the trace).

`persistent_names` (models/zero3.py), `leaf_names` and `granularities` apply those rules to any `torch.nn.Module`
(the meta-device real shape, or a tiny one). A tiny model of the same module tree (same classes and
names, small widths) needs its own settings for the same effect (`small_zero_settings`):
`equivalent_persistence` finds the threshold that keeps the same parameters whole, a granularity
threshold's leaves are named outright, and `scaled_volume` scales element volumes by the decoder
layer's size.
"""

from __future__ import annotations

import sys
from typing import Callable

import torch

from flexrl_ds.models.zero3 import layer_modules, persistent_names

Z3_MAX_LEAF_SIZE = 10**9
"""DeepSpeed's bound on a leaf chosen by granularity: a module over this many elements never is one."""
NEVER = sys.maxsize
"""The granularity of a module DeepSpeed never makes a leaf."""
ALL = 10**15
"""A threshold above any parameter's elements (every parameter persistent)."""
DEEPSPEED_DEFAULTS = {"stage3_prefetch_bucket_size": 5e7, "stage3_max_live_parameters": 1e9,
                      "stage3_max_reuse_distance": 1e9, "stage3_param_persistence_threshold": 1e5}
"""DeepSpeed 0.19.8's values of the settings a model's size changes the meaning of (runtime/zero/config.py)."""
LEAVES_KEY = "leaves_by_granularity"
"""Not DeepSpeed's: the modules a granularity threshold of this value would make leaves are marked
with `set_z3_leaf_modules` (as a family's MoE blocks are), the threshold left at 0 (DeepSpeed's
faster leaf release off)."""
LAYER_LEAVES_KEY = "leaves_layers"
"""Not DeepSpeed's: every decoder layer and vision block (`layer_leaf_names`) marked a leaf."""
VOLUME_KEYS = ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance")
"""ZeRO-3 settings counted in elements of parameters."""


def granularities(model: torch.nn.Module) -> dict[str, int]:
    """Every module's granularity by DeepSpeed's rule (module docstring), by name ("" the root)."""
    out: dict[str, int] = {}
    _granularity(model, "", out)
    return out


def _granularity(module: torch.nn.Module, name: str, out: dict[str, int]) -> tuple[int, int]:
    """(layers, elements) of `module`'s subtree, recording its granularity in `out`."""
    out[name] = NEVER
    if not any(True for _ in module.parameters()):
        return 0, 0
    elements = sum(p.numel() for p in module.parameters(recurse=False))
    children = list(module.named_children())
    if not children:
        return 1, elements
    layers = 0
    for child_name, child in children:
        child_layers, child_elements = _granularity(child, f"{name}.{child_name}" if name else child_name, out)
        layers += child_layers
        elements += child_elements
    if type(module).__name__ in torch.nn.modules.container.__all__:
        return layers, elements
    layers += 1
    out[name] = elements // layers if elements <= Z3_MAX_LEAF_SIZE else NEVER
    return layers, elements


def leaf_names(model: torch.nn.Module, threshold: int) -> list[str]:
    """Modules DeepSpeed makes ZeRO-3 leaves under `stage3_module_granularity_threshold` `threshold`
    (parents first; none at 0)."""
    if threshold <= 0:
        return []
    values = granularities(model)
    leaves: list[str] = []

    def visit(module: torch.nn.Module, name: str) -> None:
        if not any(True for _ in module.parameters()):
            return
        if values[name] <= threshold:
            leaves.append(name)
            return
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    visit(model, "")
    return leaves


def layer_leaf_names(model: torch.nn.Module) -> list[str]:
    """The repeated layers' names (models/zero3.py `layer_modules`: decoder layers, vision blocks)."""
    return [name for name, _ in layer_modules(model)]


def leaf_elements(model: torch.nn.Module, names: list[str]) -> int:
    """Elements of the largest of the leaf modules `names` (gathered whole at once)."""
    modules = dict(model.named_modules())
    return max((sum(p.numel() for p in modules[name].parameters()) for name in names), default=0)


def equivalent_threshold(selected: Callable[[torch.nn.Module, int], list[str]], real: torch.nn.Module,
                         real_threshold: int, small: torch.nn.Module, candidates: list[int]) -> int:
    """The threshold among `candidates` (and 0 and `ALL`) that makes `selected(small, ·)` name what
    `selected(real, real_threshold)` names; ValueError naming the difference if none does."""
    wanted = selected(real, real_threshold)
    for threshold in sorted({0, ALL, *candidates}):
        if selected(small, threshold) == wanted:
            return threshold
    nearest = min(sorted({0, ALL, *candidates}),
                  key=lambda t: len(set(selected(small, t)) ^ set(wanted)))
    missing = sorted(set(wanted) ^ set(selected(small, nearest)))[:3]
    raise ValueError(f"threshold {real_threshold}: no threshold selects the same {len(wanted)} names on the small "
                     f"model (nearest {nearest}, differing in e.g. {missing})")


def equivalent_persistence(real: torch.nn.Module, threshold: int, small: torch.nn.Module) -> int:
    """The small model's `stage3_param_persistence_threshold` that keeps the same parameters whole."""
    sizes = sorted({p.numel() for p in small.parameters()})
    return equivalent_threshold(persistent_names, real, threshold, small, sizes)


def decoder_layer_elements(model: torch.nn.Module) -> int:
    """Elements of one decoder layer (the text model's first)."""
    layers = model.get_decoder().layers if hasattr(model, "get_decoder") else model.model.layers
    return sum(p.numel() for p in layers[0].parameters())


def scaled_volume(real: torch.nn.Module, value: float, small: torch.nn.Module) -> int:
    """An element volume of the real model as the small one's: as many decoder layers' worth."""
    return max(0, int(value * decoder_layer_elements(small) / decoder_layer_elements(real)))


def small_zero_settings(real: torch.nn.Module, zero: dict, small: torch.nn.Module) -> tuple[dict, list[str]]:
    """The `zero_optimization` block `zero` (written for `real`) as `small` needs it for the same effect,
    and the modules to mark as ZeRO-3 leaves on `small` before the engine is built. The settings
    `zero` leaves out take DeepSpeed's defaults (`DEEPSPEED_DEFAULTS`), translated too.

    A granularity threshold's leaves are named outright (what DeepSpeed does with the threshold: it
    marks them): the width ratios of a tiny model order its modules' granularities differently (a
    patch embedding's grows with the width, a block's with its square), so no threshold need select
    the same modules there. The threshold becomes 1 (still on: DeepSpeed's faster release of a leaf's
    parameters applies, and no module of a tiny model is that fine)."""
    out, leaves = {**DEEPSPEED_DEFAULTS, **zero}, []
    if "stage3_param_persistence_threshold" in zero:
        out["stage3_param_persistence_threshold"] = equivalent_persistence(
            real, int(float(zero["stage3_param_persistence_threshold"])), small)
    if int(float(zero.get("stage3_module_granularity_threshold", 0))) > 0:
        leaves = leaf_names(real, int(float(zero["stage3_module_granularity_threshold"])))
        out["stage3_module_granularity_threshold"] = 1
    if LEAVES_KEY in out:
        leaves = leaf_names(real, int(float(out.pop(LEAVES_KEY))))
    if out.pop(LAYER_LEAVES_KEY, False):
        leaves = layer_leaf_names(real)
    for key in VOLUME_KEYS:  # DeepSpeed's defaults too: they are volumes of the real model's size
        out[key] = scaled_volume(real, float(out[key]), small)
    return out, leaves
