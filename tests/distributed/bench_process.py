"""Runs a `flexrl bench` subcommand in a process of its own (one rank of its own: no inherited
rendezvous variables) and returns its JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench_json(name: str, json_path: Path, *arguments: str, timeout_s: int = 600) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(variable, None)
    completed = subprocess.run([sys.executable, "-m", "flexrl_ds", "bench", name, *arguments, "--json", str(json_path)],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return json.loads(json_path.read_text())
