"""models/policy_update.local_response_values (what the trainer's ranks use) against a plain per-token
reference built from the plan's packs."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from flexrl_ds.models.processing import EncodedSample
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.planning.plan import SequenceSpec, Workload
from flexrl_ds.planning.planner import plan_step
from flexrl_ds.sp.layout import build_rank_layout
from flexrl_ds.models.policy_update import local_response_values

WORLD = 4
LENGTHS = [5000, 40, 300, 5, 1200, 77, 600, 2, 9]


def _owners(layout) -> list[tuple[str, int]]:
    """(sequence id, position) of each local token, from the packs' shard bounds (not segments())."""
    owners = []
    for pack in layout.packs:
        for token in range(pack.shard_bounds[pack.rank_in_group], pack.shard_bounds[pack.rank_in_group + 1]):
            index = max(i for i, start in enumerate(pack.cu_seqlens[:-1]) if start <= token)
            owners.append((pack.sequence_ids[index], token - pack.cu_seqlens[index]))
    return owners


def _step():
    rng = random.Random(3)
    samples, old, ref, adv = {}, {}, {}, {}
    for index, length in enumerate(LENGTHS):
        name = f"s0p{index}k0"
        start = rng.randint(1, length - 1)  # at least one prompt and one response token
        samples[name] = EncodedSample(name, torch.arange(length), start)
        old[name] = [-(1000.0 * index + j + 1) for j in range(length - start)]
        ref[name] = [value - 0.25 for value in old[name]]
        adv[name] = float(index + 1)
    workload = Workload(tuple(SequenceSpec(name, s.length) for name, s in samples.items()))
    plan = plan_step(workload, WORLD, load_cost_model("qwen2.5-vl-7b"), SPConfig(p_max=WORLD)).plan
    lengths = {name: s.length for name, s in samples.items()}
    layouts = [build_rank_layout(plan, lengths, rank) for rank in range(WORLD)]
    return samples, old, ref, adv, plan, layouts


def _expected(owners, samples, old, ref, adv):
    """Plain reference: position p of a sample predicts token p+1; a response target j sits at
    p = response_start - 1 + j."""
    rows = []
    for seq_id, position in owners:
        sample = samples[seq_id]
        j = position - (sample.response_start - 1)
        if 0 <= j < sample.length - sample.response_start:
            rows.append((True, old[seq_id][j], ref[seq_id][j], adv[seq_id]))
        else:
            rows.append((False, 0.0, 0.0, 0.0))
    return rows


def test_plan_has_mixed_degrees():
    _, _, _, _, plan, _ = _step()
    assert len({pack.degree for pack in plan.packs}) > 1


def _batch(layout, samples):
    return SimpleNamespace(layout=layout, response_tokens={n: s.length - s.response_start for n, s in samples.items()})


def test_local_values_match_the_reference_on_every_rank():
    samples, old, ref, adv, _, layouts = _step()
    for layout in layouts:
        owners = _owners(layout)
        assert owners == [(s, p) for s, lo, hi, _ in layout.segments() for p in range(lo, hi)]
        rows = _expected(owners, samples, old, ref, adv)
        batch = _batch(layout, samples)
        for values, column in ((old, 1), (ref, 2), (adv, 3)):
            local = local_response_values(batch, values)
            assert local.shape == (layout.num_local_tokens,)
            assert local.tolist() == [row[column] for row in rows]


def test_union_over_ranks_covers_each_response_token_once():
    samples, old, ref, adv, _, layouts = _step()
    seen: dict[tuple[str, float], int] = {}
    for layout in layouts:
        owners = _owners(layout)
        rows = _expected(owners, samples, old, ref, adv)
        batch = _batch(layout, samples)
        local_old, local_adv = local_response_values(batch, old), local_response_values(batch, adv)
        for (seq_id, _), row, value, advantage in zip(owners, rows, local_old.tolist(), local_adv.tolist()):
            if row[0]:
                assert advantage == adv[seq_id]
                seen[(seq_id, value)] = seen.get((seq_id, value), 0) + 1
            else:
                assert value == 0.0 and advantage == 0.0
    expected = {(seq_id, value) for seq_id, values in old.items() for value in values}
    assert set(seen) == expected
    assert all(count == 1 for count in seen.values())
