"""Architecture rules as tests (see docs/ARCHITECTURE.md, "Rules")."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "flexrl_ds"
DEVICE_MODULE = PACKAGE / "parallel" / "device.py"

PURE_FOLDERS = ("common", "planning", "rl")
"""Folders whose every module is pure: planning and math, testable without a process group or a cluster."""
PURE_MODULES = ("config/flexrl_config.py", "bench/workloads.py")
"""Pure modules outside the pure folders."""
FORBIDDEN_IN_PURE = ("torch.distributed", "ray", "deepspeed")
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 60


def package_files():
    return sorted(PACKAGE.rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at module top or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def pure_files() -> list[Path]:
    files = []
    for folder in PURE_FOLDERS:
        path = PACKAGE / folder
        assert path.is_dir() and any(path.glob("*.py")), f"pure folder flexrl_ds/{folder} is missing or empty"
        files.extend(sorted(path.rglob("*.py")))
    for relative in PURE_MODULES:
        path = PACKAGE / relative
        assert path.exists(), f"pure module flexrl_ds/{relative} is listed but missing"
        files.append(path)
    return files


def test_only_the_device_module_names_backends():
    pattern = re.compile(r"""["'](cuda|nccl)["']|torch\.cuda\b|torch\.backends\.cud""")
    offenders = [
        f"{path.relative_to(PACKAGE)}:{lineno}"
        for path in package_files()
        if path != DEVICE_MODULE and "gpu" not in path.parts
        for lineno, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not offenders, f"cuda/nccl named outside parallel/device.py: {offenders}"


def test_pure_folders_import_no_distributed_runtime():
    for path in pure_files():
        for module in imported_modules(path):
            assert not any(module == bad or module.startswith(bad + ".") for bad in FORBIDDEN_IN_PURE), (
                f"{path.relative_to(PACKAGE)} imports {module}: pure modules must not"
            )


def test_vllm_and_flash_attn_only_in_their_backends():
    for path in package_files():
        for module in imported_modules(path):
            if module.split(".")[0] == "vllm":
                assert path.name.startswith("vllm"), f"{path} imports vllm"
            if module.split(".")[0] == "flash_attn":
                assert "flash" in path.name, f"{path} imports flash_attn"


def top_level_graph() -> dict[str, set[str]]:
    """Top-level package (or module) of flexrl_ds -> the top-level packages it imports."""
    graph: dict[str, set[str]] = {}
    for path in package_files():
        parts = path.relative_to(PACKAGE).parts
        if len(parts) == 1:
            continue  # flexrl_ds/__init__.py, __main__.py
        source = parts[0]
        for module in imported_modules(path):
            if module.startswith("flexrl_ds."):
                target = module.split(".")[1]
                if target != source:
                    graph.setdefault(source, set()).add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles_between_top_level_packages():
    cycle = find_cycle(top_level_graph())
    assert cycle is None, f"import cycle between top-level packages: {' -> '.join(cycle)}"


def test_cycle_finder_finds_cycles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}}) is None


def test_files_stay_small():
    too_long = {
        str(p.relative_to(PACKAGE)): n
        for p in package_files()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not too_long, f"files over {MAX_FILE_LINES} lines: {too_long}"


def long_functions() -> dict[str, int]:
    out = {}
    for path in package_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                # the docstring does not count
                if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
                    body = body[1:] or body
                length = node.end_lineno - body[0].lineno + 1
                if length > MAX_FUNCTION_LINES:
                    out[f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"] = length
    return out


def test_functions_stay_small():
    too_long = long_functions()
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines (docstring excluded): {too_long}"


def test_no_monkey_patching_of_model_classes():
    pattern = re.compile(r"^\s*(transformers\.\S+|Qwen\w+|\w+Attention)\.\w+\s*=", re.MULTILINE)
    offenders = [str(p) for p in package_files() if pattern.search(p.read_text())]
    assert not offenders, f"assignments onto model classes: {offenders}"
