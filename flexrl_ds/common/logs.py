"""Console logging with levels: one logger per package, all under the `flexrl_ds` logger.

A module logs through its package's logger, `log = logging.getLogger(__package__)`
(`flexrl_ds.trainer`, `flexrl_ds.runtime`, ...). `setup()` (run when flexrl_ds is imported) gives the
`flexrl_ds` logger one console handler that writes each message alone, as the `print` calls it
replaced did: INFO and DEBUG to stdout, WARNING and above to stderr, to the streams of the moment (a
redirected or captured stdout too). The level is `FLEXRL_LOG_LEVEL` (DEBUG, INFO, WARNING, ERROR;
default INFO), or `flexrl --log-level LEVEL`, which also sets the variable so that the processes the
command starts log at the same level (Ray workers take it with the trainer's WORKER_ENV_KEYS). A
worker's lines reach the driver through common/notes.py `say`, at the worker's level.
"""

from __future__ import annotations

import logging
import os
import sys

ENV_VAR = "FLEXRL_LOG_LEVEL"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
"""Level names `FLEXRL_LOG_LEVEL` and `--log-level` take."""
DEFAULT_LEVEL = "INFO"
ROOT = "flexrl_ds"
"""The logger every package's logger sits under."""


class ConsoleHandler(logging.Handler):
    """Each record's message alone: below WARNING to sys.stdout, from WARNING on to sys.stderr, looked up
    at each record (pytest's capture, a redirected stream), flushed at once."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stdout if record.levelno < logging.WARNING else sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own convention: report, never raise
            self.handleError(record)


def level_number(name: str, where: str) -> int:
    """The logging level of a name of LEVELS (any case); ValueError naming `where` otherwise."""
    if name.upper() not in LEVELS:
        raise ValueError(f"{where}: {name!r} is not one of {', '.join(LEVELS)}")
    return logging.getLevelName(name.upper())


def setup(level: str | None = None) -> None:
    """Give the `flexrl_ds` logger its console handler (once) and set its level: `level` where given
    (also exported as FLEXRL_LOG_LEVEL for the processes started from here), else FLEXRL_LOG_LEVEL's,
    else INFO."""
    if level is not None:
        number = level_number(level, "--log-level")
        os.environ[ENV_VAR] = level.upper()
    else:
        number = level_number(os.environ.get(ENV_VAR) or DEFAULT_LEVEL, ENV_VAR)
    root = logging.getLogger(ROOT)
    if not any(isinstance(handler, ConsoleHandler) for handler in root.handlers):
        root.addHandler(ConsoleHandler())
        root.propagate = False  # the messages are printed here once, not again by a root handler
    root.setLevel(number)
