"""Load OpenRLHF 0.11.2's loss code by file path, as a reference for the tests (not as a package).

`import openrlhf` cannot work here: its `__init__` pulls in flash-attn and vLLM, and it pins other
DeepSpeed, Ray and transformers versions. Its `openrlhf/models/loss.py` and `models/utils.py` are
plain torch, so this loader finds the installed distribution's directory without importing it
(`importlib.util.find_spec` on a top-level name locates it without running its `__init__`) and
executes just those two files under a private package name, `_openrlhf_ref`, an empty module
object whose `__path__` is the real `models/` folder: `loss.py`'s `from .utils import masked_mean`
then resolves to the utils module loaded here. Nothing in site-packages is changed, nothing is
patched. Install it without its dependencies: `pip install --no-deps openrlhf==0.11.2`
(scripts/install.sh does).

`models/utils.py` imports deepspeed at the top (installed here) and flash-attn only inside a
function these tests never call; its `@torch.compile` only wraps `compute_entropy` lazily.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

PACKAGE = "_openrlhf_ref"
VERSION = "0.11.2"


def openrlhf_models_dir() -> Path | None:
    """The installed openrlhf's `models/` folder, or None when it is not installed."""
    spec = importlib.util.find_spec("openrlhf")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "models"


def installed_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("openrlhf")
    except PackageNotFoundError:
        return None


def load_openrlhf_losses() -> tuple[types.ModuleType, types.ModuleType]:
    """(loss module, utils module) of the installed OpenRLHF, loaded by file (module docstring)."""
    if PACKAGE in sys.modules:
        return sys.modules[f"{PACKAGE}.loss"], sys.modules[f"{PACKAGE}.utils"]
    models = openrlhf_models_dir()
    if models is None:
        raise ImportError("openrlhf is not installed (pip install --no-deps openrlhf==0.11.2)")
    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(models)]
    sys.modules[PACKAGE] = package
    loaded = []
    for name in ("utils", "loss"):  # utils first: loss imports from it
        spec = importlib.util.spec_from_file_location(f"{PACKAGE}.{name}", models / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        loaded.append(module)
    utils, loss = loaded
    return loss, utils
