"""Small helpers every layer may use (no project imports)."""

from __future__ import annotations


def is_power_of_two(value: int) -> bool:
    """True for 1, 2, 4, 8, ...; False for 0, negatives and other integers."""
    return value >= 1 and value & (value - 1) == 0
