"""Decode where the pixels are used, on a real 2-node Ray cluster (one machine).

The cluster (`ray.cluster_utils.Cluster`) needs a head of its own, so it runs in a subprocess
(tests/ray/locality_cluster.py; ~50 s here) and the session's shared Ray (tests/ray/conftest.py)
is left alone. Per node: 2 preprocessing actors, one consumer Materializer; prompts are dealt to
the consumers by slot parity.

Why plain least-loaded must cross: with empty loads its first prompt goes to `pre-0-0` and its
second to `pre-0-1` (load 0, first by name) or back to `pre-0-0` (if the first finished): both
on one node, while slots 0 and 1 are consumed on different nodes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400)]

SCRIPT = Path(__file__).with_name("locality_cluster.py")


@pytest.fixture(scope="module")
def cluster_result(tmp_path_factory):
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    env.setdefault("RAY_AUTH_MODE", "disabled")
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path_factory.mktemp("locality"))],
                          capture_output=True, text=True, timeout=380, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_the_cluster_has_two_nodes_with_actors_and_consumers_on_both(cluster_result):
    assert cluster_result["num_nodes"] == 2 and cluster_result["consumer_nodes_differ"]
    assert cluster_result["actors_per_node"] == [2, 2]
    assert cluster_result["pool_nodes_match_actors"]  # the pool's node map = where actors say they run


@pytest.mark.parametrize("mode", ["plain", "near_inf", "near_default"])
def test_every_slice_arrives_intact_and_cross_node_bytes_are_counted_exactly(cluster_result, mode):
    run = cluster_result[mode]
    assert run["num_tensors"] == 8 and run["num_equal"] == 8  # equal to a single-process decode
    assert run["bytes"] == cluster_result["plain"]["bytes"] > 0  # same pixels whatever the routing
    assert run["cross"] == run["expected_cross"]  # Materializers' count = owners' nodes vs consumers'
    assert 0 <= run["cross"] <= run["bytes"]


def test_node_aware_routing_moves_nothing_across_nodes_while_least_loaded_does(cluster_result):
    assert cluster_result["near_inf"]["cross"] == 0
    assert cluster_result["plain"]["cross"] > 0
    # near_default (slack 1) may spill a prompt when its node's actors are busy: timing, not asserted
