"""Architecture rules as tests (see docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "flexrl_ds"
DEVICE_MODULE = PACKAGE / "parallel" / "device.py"

# Pure modules: planning and math, testable without a process group or a cluster.
PURE_MODULES = [
    "config/typed.py",
    "config/flexrl_config.py",
    "config/json_files.py",
    "sp/placement.py",
    "sp/plan.py",
    "sp/cost_model.py",
    "sp/planner.py",
    "sp/packing.py",
    "sp/schedule.py",
    "sp/baselines.py",
    "sp/metrics.py",
    "sp/attention_repair.py",
    "sp/attention_search.py",
    "bench/workloads.py",
    "rl/advantages.py",
    "rl/losses.py",
    "rl/config.py",
    "rl/rewards.py",
]
FORBIDDEN_IN_PURE = ("torch.distributed", "ray", "deepspeed")


def package_files():
    return sorted(PACKAGE.rglob("*.py"))


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


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


def test_pure_modules_import_no_distributed_runtime():
    for relative in PURE_MODULES:
        path = PACKAGE / relative
        if not path.exists():
            continue
        for module in imported_modules(path):
            assert not any(module == bad or module.startswith(bad + ".") for bad in FORBIDDEN_IN_PURE), (
                f"{relative} imports {module}: pure modules must not"
            )


def test_vllm_and_flash_attn_only_in_their_backends():
    for path in package_files():
        for module in imported_modules(path):
            if module.split(".")[0] == "vllm":
                assert path.name.startswith("vllm"), f"{path} imports vllm"
            if module.split(".")[0] == "flash_attn":
                assert "flash" in path.name, f"{path} imports flash_attn"


def test_files_stay_small():
    too_long = {
        str(p.relative_to(PACKAGE)): n
        for p in package_files()
        if (n := len(p.read_text().splitlines())) > 550
    }
    assert not too_long, f"files over ~500 lines: {too_long}"


def test_no_monkey_patching_of_model_classes():
    pattern = re.compile(r"^\s*(transformers\.\S+|Qwen\w+|\w+Attention)\.\w+\s*=", re.MULTILINE)
    offenders = [str(p) for p in package_files() if pattern.search(p.read_text())]
    assert not offenders, f"assignments onto model classes: {offenders}"
