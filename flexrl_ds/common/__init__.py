"""Small helpers every layer may use (no project imports)."""

from __future__ import annotations


def is_power_of_two(value: int) -> bool:
    """True for 1, 2, 4, 8, ...; False for 0, negatives and other integers."""
    return value >= 1 and value & (value - 1) == 0


class RunInputError(ValueError):
    """The run's own input (its data, reward function or config) leaves it nothing to go on with; the
    message names the record, function or key and the reason. A ValueError, so `flexrl` prints it as
    one line without a traceback (cli/main.py; FLEXRL_DEBUG=1 shows the traceback)."""
