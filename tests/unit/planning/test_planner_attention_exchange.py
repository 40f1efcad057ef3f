"""Attention exchanges across p-blocks (placement._exchange_pairs): 2-for-1 swaps at a cost ceiling."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from flexrl_ds.bench.workloads import make_workload
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.baselines import fixed_sp
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.planning.placement import _exchange_pairs, _improve
from flexrl_ds.planning.planner import PlannerOptions, plan_step

COST = load_cost_model("qwen2.5-vl-7b")


def _values(tokens) -> np.ndarray:
    tokens = np.asarray(tokens, dtype=float)
    return np.stack([tokens * tokens + COST.c * tokens, tokens * tokens, tokens])


def _half_cost_length(length: int) -> int:
    """The integer length whose cost is nearest to half the cost of `length`."""
    target = (length * length + COST.c * length) / 2
    exact = (-COST.c + np.sqrt(COST.c ** 2 + 4 * target)) / 2
    return int(round(exact))


def test_two_for_one_swap_lowers_attention_where_single_moves_and_swaps_cannot():
    """Block 0 holds two 4000-token items, block 1 four items of half that cost each: equal cost,
    block 0 has ~1.9× the attention. Every single move or swap raises one block's cost (lengths
    differ, cost is monotone in length); trading one 4000 for two halves keeps cost and evens
    attention."""
    half = _half_cost_length(4000)
    values = _values([4000, 4000, half, half, half, half])
    blocks = np.array([0, 0, 1, 1, 1, 1])
    sums = np.stack([np.bincount(blocks, weights=row) for row in values])
    ceilings = np.array([sums[0].max() * (1 + 1e-4), np.inf, np.inf])
    good_enough = sums[1].mean()

    single = blocks.copy()
    _improve(single, values, 1, ceilings, 8, 2, good_enough)
    assert (single == blocks).all()  # no move/swap fits under the cost ceiling

    _exchange_pairs(values, blocks, 2, ceilings, 8, good_enough)
    after = np.stack([np.bincount(blocks, weights=row, minlength=2) for row in values])
    assert after[0].max() <= ceilings[0]
    assert after[1].max() < 0.8 * sums[1].max()
    assert sorted(np.bincount(blocks, minlength=2).tolist()) == [3, 3]


def test_image_heavy_256_on_128_ranks_seed_1():
    """The grid cell whose attention stayed at 1.07 (bound 1.022): exchanges across the 16
    8-rank blocks alone (attention repair off) bring it to ≤ 1.065 with efficiency and cost
    balance unchanged in kind (every block's cost at or under the busiest block's). Its 8 blocks
    holding a 38k- and a 30k-token video carry ≥ 1.02 × mean attention from those two alone and
    must fill the rest of their cost with short sequences, so at a cost tolerance of 0.1 % about
    1.047 is the fractional optimum. Measured with 32 query heads (8 per rank at degree 8, the
    even split this claim is about); with 28 heads the head split's 8/7 dominates attention."""
    workload = make_workload("image-heavy", 256, seed=1)
    even = replace(COST, shapes=replace(COST.shapes, num_heads=32, num_kv_heads=8))  # same c
    metrics = plan_step(workload, 128, even, SPConfig(p_max=8)).metrics
    sp8 = fixed_sp(workload, 128, even, 8, 8).metrics
    assert metrics.efficiency >= max(0.97, sp8.efficiency - 2 * PlannerOptions().balance_tolerance)
    assert metrics.cost_balance <= 1.03
    assert metrics.attention_balance <= 1.065
    assert metrics.attention_balance >= metrics.attention_balance_bound - 1e-9
