"""Ray tests share ONE local Ray cluster per pytest session (starting Ray costs ~10-20 s here)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    started_here = not ray.is_initialized()
    if started_here:
        # logical CPUs: actors ask for fractions; the machine may have only 2 cores
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    if started_here:
        ray.shutdown()
