"""The install equals its lock: every package `pip freeze` lists in the project's .venv (made by
scripts/install.sh) is pinned by requirements/cpu-lock.txt at the version installed, and every
pinned package is installed; the GPU lock pins what setup.cfg's gpu extra names."""

from __future__ import annotations

import configparser
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
CPU_LOCK, GPU_LOCK = ROOT / "requirements" / "cpu-lock.txt", ROOT / "requirements" / "gpu-lock.txt"
NOT_LOCKED = {"pip", "flexrl-ds"}
"""pip upgrades itself (scripts/install.sh); flexrl_ds is the project, installed editable."""


def pins(lines: list[str]) -> dict[str, str]:
    """name (canonical) -> version of each `name==version` line; comments and other lines skipped."""
    found = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if "==" in line and not line.startswith("-"):
            name, version = line.split("==", 1)
            found[canonicalize_name(name)] = version.strip()
    return found


def lock_differences(installed: dict[str, str], locked: dict[str, str]) -> list[str]:
    """Each way the installed packages differ from the lock (a local label such as torch's "+cpu" is
    the index's build of the pinned version: `==2.13.0` accepts 2.13.0+cpu, as pip does)."""
    installed = {name: version for name, version in installed.items() if name not in NOT_LOCKED}
    lines = [f"{name} {version}: installed, not in the lock" for name, version in sorted(installed.items())
             if name not in locked]
    lines += [f"{name}: pinned to {version}, not installed" for name, version in sorted(locked.items())
              if name not in installed]
    lines += [f"{name}: {installed[name]} installed, the lock pins {version}" for name, version in sorted(locked.items())
              if name in installed and Version(installed[name]) not in SpecifierSet(f"=={version}")]
    return lines


def test_every_lock_line_is_one_exact_pin():
    for lock in (CPU_LOCK, GPU_LOCK):
        lines = [line for line in lock.read_text().splitlines() if line and not line.startswith("#")]
        assert len(pins(lines)) == len(lines), f"{lock.name}: a line that is no single name==version, or a name twice"
        for line in lines:
            requirement = Requirement(line)
            assert str(requirement.specifier).startswith("==") and len(requirement.specifier) == 1, line


def test_the_comparison_names_each_difference():
    locked = {"torch": "2.13.0", "numpy": "2.4.6", "ray": "2.60.0"}
    assert lock_differences({"torch": "2.13.0+cpu", "numpy": "2.4.6", "ray": "2.60.0", "pip": "26.3"}, locked) == []
    assert lock_differences({"torch": "2.13.1", "numpy": "2.4.6", "extra": "1.0"}, locked) == [
        "extra 1.0: installed, not in the lock", "ray: pinned to 2.60.0, not installed",
        "torch: 2.13.1 installed, the lock pins 2.13.0"]


def test_the_gpu_lock_pins_the_gpu_extras_version():
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    extras = [Requirement(line) for line in setup["options.extras_require"]["gpu"].split("\n") if line.strip()]
    locked = pins(GPU_LOCK.read_text().splitlines())
    for requirement in extras:
        assert canonicalize_name(requirement.name) in locked, requirement.name
        assert Version(locked[canonicalize_name(requirement.name)]) in requirement.specifier, requirement


def test_the_install_is_what_the_lock_pins():
    venv = ROOT / ".venv"
    if not venv.exists() or Path(sys.prefix).resolve() != venv.resolve():
        pytest.skip(f"not run in the project's install ({venv}, made by scripts/install.sh): {sys.prefix}")
    if not (venv / ".flexrl-installed").is_file():
        pytest.skip(f"{venv} was not made by scripts/install.sh (no .flexrl-installed stamp)")
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze", "--all", "--exclude-editable"], check=True,
                            capture_output=True, text=True).stdout.splitlines()
    differences = lock_differences(pins(freeze), pins(CPU_LOCK.read_text().splitlines()))
    assert not differences, ("the install differs from requirements/cpu-lock.txt (bash scripts/install.sh installs "
                             "the lock; scripts/lock.sh refreshes it):\n" + "\n".join(differences))
