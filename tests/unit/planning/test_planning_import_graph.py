"""planning/ modules import each other at module top without a cycle (no function-level imports
standing in for one), and each imports first in a fresh interpreter."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_architecture import find_cycle  # noqa: E402  (the one cycle finder of the import tests)

PLANNING = Path(__file__).resolve().parents[3] / "flexrl_ds" / "planning"
MODULES = sorted(p.stem for p in PLANNING.glob("*.py") if p.stem != "__init__")


def _planning_imports(path: Path) -> tuple[set[str], set[str]]:
    """(planning modules imported at module top, those imported inside functions)."""
    tree = ast.parse(path.read_text())
    top = {node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))}
    at_top, inside = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flexrl_ds.planning."):
            (at_top if node in top else inside).add(node.module.rsplit(".", 1)[1])
    return at_top, inside


def test_no_import_cycle_inside_planning():
    graph = {name: set().union(*_planning_imports(PLANNING / f"{name}.py")) for name in MODULES}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
    assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]  # the finder finds one


def test_baselines_and_planner_import_each_other_only_one_way_at_module_top():
    base_top, base_inside = _planning_imports(PLANNING / "baselines.py")
    plan_top, plan_inside = _planning_imports(PLANNING / "planner.py")
    assert "planner" in base_top and "planner" not in base_inside
    assert "baselines" not in plan_top | plan_inside


@pytest.mark.parametrize("module", ["baselines", "planner"])
def test_module_imports_first_in_a_fresh_interpreter(module):
    done = subprocess.run([sys.executable, "-c", f"import flexrl_ds.planning.{module}"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
