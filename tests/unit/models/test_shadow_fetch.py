"""Rank side of `flexrl logprobs --loader shadow` without Ray: which units a rank fetches, how they
become slice requests, and that the fetched rows stand in for the whole item's pixels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flexrl_ds.loader.metastore import PromptKey
from flexrl_ds.models.flex_model import build_step_batch, positions_fn
from flexrl_ds.models.sample_data import random_plan_for
from flexrl_ds.runtime.rank_pixels import FetchedRows, rank_units, unit_requests
from flexrl_ds.models.vision_balance import VisionUnit, unit_pixels


def _unit(seq_id, item_index, t_index):
    return VisionUnit(seq_id, item_index, t_index, (2, 2), 0, 1)


def test_unit_requests_merge_consecutive_groups_per_item():
    keys = {"a": PromptKey(0, 0), "b": PromptKey(0, 1)}
    units = [_unit("a", 0, 3), _unit("a", 0, 0), _unit("b", 1, 0), _unit("a", 0, 1), _unit("a", 2, 0)]
    got = [(r.prompt, r.item_index, r.t_start, r.t_stop) for r in unit_requests(units, keys)]
    assert sorted(got) == sorted([(keys["a"], 0, 0, 2), (keys["a"], 0, 3, 4), (keys["b"], 1, 0, 1),
                                  (keys["a"], 2, 0, 1)])


def test_fetched_rows_serve_fetched_groups_only():
    full = torch.randn(4 * 6, 5)  # grid (4, 2, 3): 6 rows per temporal group
    rows = FetchedRows((4, 2, 3), [(3, full[18:24]), (0, full[0:12])])
    assert rows.shape == (24, 5)
    torch.testing.assert_close(rows[6:12], full[6:12], atol=0, rtol=0)
    torch.testing.assert_close(rows[18:24], full[18:24], atol=0, rtol=0)
    with pytest.raises(KeyError, match="not fetched"):
        rows[12:18]
    with pytest.raises(KeyError):
        rows[6:24]  # spans a group that is not here


@pytest.mark.parametrize("world,seed", [(2, 0), (4, 1)])
def test_rank_units_from_config_match_the_batch_and_cover_every_unit_once(vl_samples, world, seed):
    model, samples = vl_samples
    plan = random_plan_for({s: x.length for s, x in samples.items()}, world, world, seed=seed)
    keys = {seq_id: PromptKey(0, slot) for slot, seq_id in enumerate(samples)}
    seen = []
    for rank in range(world):
        units = rank_units(model.config, plan, samples, rank)
        assert units == build_step_batch(model.config, plan, samples, rank, positions=positions_fn(model)).route.my_units
        seen += units
        # what the rank would fetch: only its requests' groups, cut from the real pixels
        runs = {}
        for request in unit_requests(units, keys):
            seq_id = next(s for s, k in keys.items() if k == request.prompt)
            item = samples[seq_id].items[request.item_index]
            per_group = item.grid_thw[1] * item.grid_thw[2]
            runs.setdefault((seq_id, request.item_index), []).append(
                (request.t_start, item.pixel_values[request.t_start * per_group:request.t_stop * per_group]))
        for unit in units:
            item = samples[unit.seq_id].items[unit.item_index]
            fetched = dataclasses.replace(item, pixel_values=FetchedRows(item.grid_thw, runs[(unit.seq_id, unit.item_index)]))
            torch.testing.assert_close(unit_pixels(unit, fetched), unit_pixels(unit, item), atol=0, rtol=0)
    expected = sum(item.grid_thw[0] for sample in samples.values() for item in sample.items)
    assert len(seen) == len(set(seen)) == expected  # no media shared here: each unit encoded by one rank
