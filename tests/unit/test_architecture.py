"""Architecture rules as tests (see docs/ARCHITECTURE.md, "Rules")."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


LAZY_MARK = "lazy:"
"""A function-level import of a flexrl_ds module carries a comment with this on its line (or the line
above) saying why it is not at module top, e.g. `# lazy: vllm is a GPU-only extra`."""


def function_level_project_imports(path: Path) -> list[ast.stmt]:
    """Imports of flexrl_ds modules (or relative ones) inside functions of `path`, in line order."""
    found: dict[int, ast.stmt] = {}
    for function in ast.walk(ast.parse(path.read_text())):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Import):
                project = any(alias.name.split(".")[0] == "flexrl_ds" for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                project = node.level > 0 or (node.module or "").split(".")[0] == "flexrl_ds"
            else:
                continue
            if project:
                found[node.lineno] = node
    return [found[lineno] for lineno in sorted(found)]


def unexplained_lazy_imports(paths: list[Path]) -> list[str]:
    """`file:line` of each function-level flexrl_ds import without a `lazy:` comment nearby."""
    out = []
    for path in paths:
        lines = path.read_text().splitlines()
        for node in function_level_project_imports(path):
            nearby = lines[max(0, node.lineno - 2):node.end_lineno]  # the line above and the import's lines
            if not any(LAZY_MARK in line.partition("#")[2] for line in nearby):
                out.append(f"{path.name}:{node.lineno}")
    return out


def test_project_imports_inside_functions_say_why():
    offenders = [f"{path.parent.relative_to(PACKAGE)}/{where}" for path in package_files()
                 for where in unexplained_lazy_imports([path])]
    assert not offenders, (f"flexrl_ds imports inside functions without a '# {LAZY_MARK} <why>' comment (move "
                           f"them to module top, or say why they cannot be there): {offenders}")


def test_lazy_import_finder_sees_function_level_imports(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("from flexrl_ds.common import typed\n\n\ndef f():\n    import os\n"
                      "    from flexrl_ds.planning import plan\n\n    def g():\n"
                      "        # lazy: a reason\n        import flexrl_ds.parallel.device\n")
    assert [node.lineno for node in function_level_project_imports(sample)] == [6, 10]
    assert unexplained_lazy_imports([sample]) == ["sample.py:6"]


HEAVY_MODULES = ("torch", "numpy", "ray", "transformers", "deepspeed", "vllm")
"""Modules `flexrl --help` must not import: it has to answer fast (every handler imports its own)."""


@pytest.mark.parametrize("argv", [["--help"], ["bench", "--help"], ["plan", "--help"]])
def test_help_imports_no_heavy_module(argv):
    probe = ("import runpy, sys\n"
             f"sys.argv = ['flexrl', *{argv!r}]\n"
             "try:\n    runpy.run_module('flexrl_ds', run_name='__main__', alter_sys=True)\n"
             "except SystemExit as exit:\n    assert exit.code in (0, None), exit.code\n"
             f"print('HEAVY', sorted(name for name in {HEAVY_MODULES!r} if name in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "HEAVY []", f"flexrl {' '.join(argv)} imported {done.stdout.splitlines()[-1]}"
