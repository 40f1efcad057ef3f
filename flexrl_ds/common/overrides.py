"""`--set KEY.PATH=VALUE` overrides of a JSON config (`flexrl train --set`). Pure: standard library only."""

from __future__ import annotations

import json
from typing import Any


def apply_overrides(raw: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """A copy of the run config `raw` with each `KEY.PATH=VALUE` of `overrides` set, in order (`flexrl
    train --set`). VALUE is read as JSON where it parses (numbers, true/false, null, lists, objects)
    and as a string otherwise; the dotted path's objects are created where missing. The `flexrl` part
    is then validated as if the file held the values (`parse_run_config`); the DeepSpeed part is
    DeepSpeed's to check. A malformed override, or one whose path runs through a non-object, raises
    ValueError naming it."""
    result = json.loads(json.dumps(raw))
    for override in overrides:
        key, sep, text = override.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ValueError(f"--set {override!r}: expected KEY.PATH=VALUE, e.g. flexrl.rl.init_kl_coef=0.01")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        node = result
        for depth, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--set {override!r}: {'.'.join(parts[:depth + 1])} is not an object in the config")
        node[parts[-1]] = value
    return result

