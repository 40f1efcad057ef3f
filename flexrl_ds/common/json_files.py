"""Reading the project's JSON inputs (run configs, workloads, plans, calibrations, model configs).

One function so that every such file fails the same way: a `ValueError` naming the path and what
the file was meant to be. Pure: standard library only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def looked_for(path: str | Path) -> str:
    """" (looked for /abs/path)" for a relative path, for errors about a missing file: under
    `ray job submit` or a launcher, relative paths resolve in the job's folder, not the user's."""
    path = Path(path)
    return "" if path.is_absolute() else f" (looked for {path.resolve()})"


def read_json(path: str | Path, what: str = "file") -> Any:
    """Parse the JSON file at `path`; `what` names it in errors ("config file", "plan", ...)."""
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: {what} not found{looked_for(path)}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: {what} is not valid JSON ({error})") from None
