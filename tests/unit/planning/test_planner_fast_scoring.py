"""The calibrated planner's candidate scoring without Plans (and its lower-bound pruning) emits the
plans of the straightforward implementation: every candidate built as a Plan (dict-grouped, as
before) and scored by plan_step_time. The reference below is that implementation, kept here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from flexrl_ds.bench.workloads import make_step, make_workload
from flexrl_ds.planning import planner, split
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.planning.heads import heads_per_rank
from flexrl_ds.planning.packing import pack_group, packing_limits
from flexrl_ds.planning.placement import lpt_groups
from flexrl_ds.planning.plan import Pack, Plan
from flexrl_ds.planning.schedule import hsf_key, hsf_rank_order
from flexrl_ds.planning.step_time import plan_step_time

SHIPPED = Path(__file__).resolve().parents[3] / "ds_configs" / "calibration" / "2xh200_bf16.json"
COST = load_cost_model("qwen2.5-vl-7b", SHIPPED)
HEADS = (COST.num_heads, COST.num_kv_heads)


def reference_pack_group(seq_indices, tokens, limits):
    """pack_group as it was: long sequences alone, short ones first-fit decreasing, longest first."""
    long_packs = [[i] for i in seq_indices if tokens[i] >= limits.h_pack]
    short = sorted((i for i in seq_indices if tokens[i] < limits.h_pack), key=lambda i: -tokens[i])
    bins, room = [], []
    for index in short:
        for b, free in enumerate(room):
            if tokens[index] <= free:
                bins[b].append(index)
                room[b] -= tokens[index]
                break
        else:
            bins.append([index])
            room.append(limits.H_pack - tokens[index])
    long_packs.sort(key=lambda pack: -tokens[pack[0]])
    return long_packs + bins


def reference_build_plan(sequences, degrees, starts, world_size, p_max, limits, heads=None, packed=None):
    """build_plan as it was: groups collected in a dict, sorted widest first, then by first rank
    (`packed`, the fast path's precomputed packs, is ignored)."""
    groups: dict[tuple[int, int], list[int]] = {}
    for index, (degree, start) in enumerate(zip(degrees.tolist(), starts.tolist())):
        groups.setdefault((degree, start), []).append(index)
    tokens, ids, packs = [s.tokens for s in sequences], [s.id for s in sequences], []
    for (degree, start), members in sorted(groups.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        for pack_members in reference_pack_group(members, tokens, limits):
            packs.append(Pack(len(packs), degree, tuple(range(start, start + degree)),
                              tuple(ids[i] for i in pack_members), heads_per_rank(*heads, degree) if heads else ()))
    assert [p.id for p in sorted(packs, key=hsf_key)] == list(range(len(packs)))
    return Plan(world_size, p_max, tuple(packs), hsf_rank_order(packs, world_size))


def reference_least_modelled_time(planned, tokens, degrees, starts, world_size, sp, cost, limits, allowed, weight,
                                  token_cap):
    """Every candidate (nested layout, fixed SP at each allowed degree) built and scored exactly;
    returns (degrees, starts, None, None): no precomputed packs or step time."""
    by_id = {s.id: s.tokens for s in planned.sequences}
    weight = planner.objective_terms(tokens, cost, allowed, sp.overlap)[0][0]
    candidates = [(degrees, starts)]
    for degree in allowed:
        groups = lpt_groups(weight, world_size // degree)
        held = np.bincount(groups, weights=tokens, minlength=world_size // degree) / degree
        if held.max() <= token_cap:
            candidates.append((np.full(len(tokens), degree, dtype=np.int64), groups * degree))
    best = None
    for layout in candidates:
        plan = reference_build_plan(planned.sequences, *layout, world_size, sp.p_max, limits, HEADS)
        seconds = plan_step_time(plan, by_id, cost.step, *HEADS, cost.shapes.head_dim, sp.overlap).step_s
        if best is None or seconds < best[0] * (1 - 1e-9):
            best = (seconds, layout)
    return (*best[1], None, None)


CASES = [(mix, num, world) for mix in ("image-heavy", "video-heavy", "only-video")
         for num, world in ((64, 8), (128, 32), (256, 64), (2048, 128))]


@pytest.mark.parametrize("mix,num,world", CASES)
def test_plans_match_the_reference_implementation(mix, num, world, monkeypatch):
    for seed in range(3):
        workload = make_workload(mix, num, seed)
        cap = int(1.25 * sum(s.tokens for s in workload.sequences) / world) + 1  # binds on some ranks
        sp = (SPConfig(), SPConfig(p_max=16) if world >= 16 else SPConfig(),
              SPConfig(overlap=False, max_tokens_per_rank=cap, oversize="truncate"))[seed]
        fast = planner.plan_step(workload, world, COST, sp)
        with monkeypatch.context() as patch:
            patch.setattr(planner, "_least_modelled_time", reference_least_modelled_time)
            patch.setattr(planner, "build_plan", reference_build_plan)
            slow = planner.plan_step(workload, world, COST, sp)
        assert fast.plan.to_json() == slow.plan.to_json(), (mix, num, world, seed)


def test_lpt_groups_matches_pop_then_push():
    import heapq

    rng = np.random.default_rng(11)
    for trial in range(100):
        costs = rng.choice([1.0, 2.0, 5.0, 7.5], 50) if trial % 2 else rng.uniform(0, 1e9, 300)
        num_groups = int(rng.integers(1, 40))
        heap, expected = [(0.0, g) for g in range(num_groups)], np.zeros(len(costs), dtype=np.int64)
        for i in np.argsort(-costs, kind="stable").tolist():
            load, g = heapq.heappop(heap)
            expected[i] = g
            heapq.heappush(heap, (load + float(costs[i]), g))
        assert lpt_groups(costs, num_groups).tolist() == expected.tolist()


def test_pack_group_matches_the_previous_first_fit():
    rng = np.random.default_rng(3)
    for trial in range(300):
        tokens = rng.choice([300, 900, 2000, 4095, 4096, 9000, 30000], int(rng.integers(1, 40))).tolist()
        limits = packing_limits(int(rng.choice([1000, 4096])), None if trial % 2 else 6000)
        members = rng.permutation(len(tokens)).tolist()
        assert pack_group(members, tokens, limits) == reference_pack_group(members, tokens, limits)


def test_layout_step_time_is_plan_step_time_bit_for_bit():
    rng = np.random.default_rng(0)
    limits = packing_limits(None, None)
    for trial in range(30):
        workload = make_step(("image-heavy", "video-heavy")[trial % 2], 16, 4, seed=trial)
        n, world = len(workload.sequences), 32
        degrees = 1 << rng.integers(0, 4, n)
        starts = rng.integers(0, world // degrees) * degrees
        tokens = [s.tokens for s in workload.sequences]
        plan = reference_build_plan(workload.sequences, degrees, starts, world, 8, limits, HEADS)
        for overlap in (True, False):
            exact = plan_step_time(plan, {s.id: s.tokens for s in workload.sequences}, COST.step, *HEADS, 128, overlap)
            fast = planner.layout_step_time(tokens, degrees, starts, world, limits, COST, overlap)
            assert (fast.step_s, fast.compute_s, fast.exposed_all_to_all_s, fast.idle_s, fast.rank_s) == \
                (exact.step_s, exact.compute_s, exact.exposed_all_to_all_s, exact.idle_s, exact.rank_s)
        assert planner.build_plan(workload.sequences, degrees, starts, world, 8, limits, HEADS) == plan


@pytest.mark.parametrize("degree", [1, 2, 4, 8])
def test_fixed_sp_floor_is_a_lower_bound(degree):
    rng = np.random.default_rng(degree)
    for trial in range(20):
        workload = make_step("image-heavy", 16, 2 + trial % 4, seed=100 + trial)
        tokens = np.array([s.tokens for s in workload.sequences], dtype=float)
        world, limits = 32, packing_limits(None, 2048 * (1 + trial % 8))
        groups = rng.integers(0, world // degree, len(tokens)) if trial % 2 else lpt_groups(tokens ** 2, world // degree)
        degrees = np.full(len(tokens), degree)
        exact = planner.layout_step_time(tokens.astype(int).tolist(), degrees, groups * degree, world, limits,
                                         COST).step_s
        assert planner.fixed_sp_time_floor(tokens, degree, world, COST, limits, groups) <= exact * (1 + 1e-12)
        assert planner.fixed_sp_time_floor(tokens, degree, world, COST, limits) <= exact * (1 + 1e-12)


def _reference_excess(loads, scale):
    """split._excess as it was (numpy on the 2 × 3 loads)."""
    normalised = np.asarray(loads) * scale
    soft = float(normalised[:, :2].max()) - 1 - split.SLACK
    hard = float(normalised[:, 2].max()) - 1 - split.SLACK if scale[:, 2].any() else -1.0
    return max(soft, hard), 0.0, hard


def _reference_bisect(items, rest, left_room, right_room):
    """split._bisect with the greedy rule written with max() and the numpy excess (as before)."""
    scale = split._scales(left_room, right_room)
    if len(rest) > split.SNAKE_ABOVE:
        return split._bisect_snake(items, rest, scale)
    (lsc, lsa, lst), (rsc, rsa, rst) = scale.tolist()
    left, right, lc, la, lt, rc, ra, rt = [], [], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    for i in rest:
        c, a, t = items.cost[i], items.attention[i], items.tokens[i]
        if max((lc + c) * lsc, (la + a) * lsa, (lt + t) * lst) <= max((rc + c) * rsc, (ra + a) * rsa, (rt + t) * rst):
            left.append(i)
            lc, la, lt = lc + c, la + a, lt + t
        else:
            right.append(i)
            rc, ra, rt = rc + c, ra + a, rt + t
    loads = [[lc, la, lt], [rc, ra, rt]]
    if _reference_excess(loads, scale)[0] > 0 and len(rest) > 1:
        repair = split._repair_small if len(rest) <= split.SMALL_REPAIR else split._repair
        left, right, loads = repair(items, left, right, loads, scale)
    return left, right, _reference_excess(loads, scale)


def test_inlined_greedy_bisect_matches_max_form():
    rng = np.random.default_rng(7)
    for trial in range(200):
        n = int(rng.integers(2, 60 if trial % 4 else 90))  # > SNAKE_ABOVE: the snake start
        tokens = rng.integers(100, 30_000, n).astype(float)
        values = np.stack([tokens ** 2 + 3e4 * tokens, tokens ** 2, tokens])
        items = split.Items(values, np.zeros(n, bool), np.ones(n, np.int64), np.zeros(n, np.int64))
        rest = np.argsort(-values[0], kind="stable").tolist()
        total = values.sum(axis=1)
        rooms = [total * rng.uniform(0.3, 0.7) for _ in range(2)]
        if trial % 3 == 0:
            rooms = [replace_inf(r, rng) for r in rooms]
        assert split._bisect(items, rest, *rooms) == _reference_bisect(items, rest, *rooms)
        loads = rng.uniform(0, 2, (2, 3)) * total
        scale = split._scales(*rooms)
        assert split._excess(loads, scale) == _reference_excess(loads, scale)
        assert split._excess(loads.tolist(), scale) == _reference_excess(loads, scale)


def replace_inf(room, rng):
    room = room.copy()
    room[int(rng.integers(0, 3))] = float("inf")
    return room
