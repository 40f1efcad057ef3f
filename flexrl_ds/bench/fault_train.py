"""Whole-run cases of `flexrl bench faults` (bench/faults.py), marked slow: they start Ray and train."""

from __future__ import annotations

CASES: list = []
