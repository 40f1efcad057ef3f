"""Console logging with levels (common/logs.py): at the default level the lines flexrl_ds printed
before still reach stdout as they were (warnings stderr); a quieter level (`FLEXRL_LOG_LEVEL`,
`flexrl --log-level`) hides the info lines, a worker's said lines included."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from flexrl_ds.cli.main import main
from flexrl_ds.common import logs, notes

SNIPPET = """
import logging
from flexrl_ds.common import notes
notes.keep()  # as in a Ray actor: said lines are kept for the driver
notes.say("said by a worker")
logging.getLogger("flexrl_ds.trainer").info("data: step 0: an info line")
logging.getLogger("flexrl_ds.trainer").warning("a warning")
print("kept:", notes.take())
"""


def run_snippet(level: str | None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != logs.ENV_VAR}
    if level is not None:
        env[logs.ENV_VAR] = level
    return subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True, text=True, timeout=120)


def test_the_default_level_keeps_the_info_lines_as_printed_before():
    done = run_snippet(None)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["said by a worker", "data: step 0: an info line",
                                        "kept: ['said by a worker']"]
    assert done.stderr.splitlines() == ["a warning"]


def test_a_quieter_level_hides_the_info_lines_and_keeps_no_said_line():
    done = run_snippet("warning")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["kept: []"]
    assert done.stderr.splitlines() == ["a warning"]


def test_an_unknown_level_is_refused_naming_the_variable():
    done = run_snippet("LOUD")
    assert done.returncode != 0 and "FLEXRL_LOG_LEVEL: 'LOUD' is not one of DEBUG, INFO, WARNING, ERROR" in done.stderr


@pytest.fixture
def restored_level(monkeypatch):
    monkeypatch.delenv(logs.ENV_VAR, raising=False)
    root = logging.getLogger(logs.ROOT)
    level = root.level
    yield root
    root.setLevel(level)


def test_the_log_level_flag_sets_the_level_here_and_for_started_processes(restored_level, capsys):
    assert main(["--log-level", "warning"]) == 2  # no command: help, but the level is set first
    assert restored_level.level == logging.WARNING and os.environ[logs.ENV_VAR] == "WARNING"
    capsys.readouterr()
    notes.say("hidden")
    logging.getLogger("flexrl_ds.trainer").info("hidden too")
    assert capsys.readouterr().out == ""
    logs.setup("INFO")
    notes.say("shown")
    assert capsys.readouterr().out == "shown\n"
