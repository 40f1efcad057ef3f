"""Helpers shared by the Ray tests."""

from __future__ import annotations

import time

import ray


def wait_until_lost(ref, timeout_s: float = 20.0) -> None:
    """Return once `ref` raises ObjectLostError: Ray frees a dead owner's objects shortly after
    noticing the death, so a reader may still map a copy for a moment."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(ref, timeout=timeout_s)
        except ray.exceptions.ObjectLostError:
            return
        time.sleep(0.2)
    raise AssertionError("the dead actor's objects stayed readable")
