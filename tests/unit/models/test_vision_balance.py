"""Vision balancing: pure assignment, route consistency, and an all-ranks emulation of the exchange."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings, strategies as st

from flexrl_ds.models.flex_model import reference_inputs, vision_route
from flexrl_ds.models.sample_data import random_plan_for
from flexrl_ds.sp.layout import build_rank_layout
from flexrl_ds.models.vision_balance import VisionRoute, assign_units, exchange_group_size, unit_pixels


@given(st.lists(st.integers(1, 500), min_size=0, max_size=40), st.sampled_from([1, 2, 4, 8]))
@settings(max_examples=200, deadline=None)
def test_assignment_is_within_one_unit_of_perfect(patches, num_ranks):
    owner = assign_units(patches, num_ranks)
    loads = [0] * num_ranks
    for p, r in zip(patches, owner):
        loads[r] += p
    assert sum(loads) == sum(patches)
    # LPT: the busiest rank exceeds the mean by at most its last (smallest) unit
    if patches:
        assert max(loads) <= sum(patches) / num_ranks + max(patches)
        if len(patches) >= num_ranks:
            assert min(loads) > 0


def test_assignment_is_deterministic_and_rejects_zero_ranks():
    assert assign_units([5, 5, 3, 3], 2) == assign_units([5, 5, 3, 3], 2)
    with pytest.raises(ValueError, match="num_ranks"):
        assign_units([1], 0)


def _layouts(model, plan, samples):
    lengths = {s: x.length for s, x in samples.items()}
    return [build_rank_layout(plan, lengths, r) for r in range(plan.world_size)]


@pytest.mark.parametrize("world,seed", [(4, 0), (8, 3)])
def test_routes_agree_between_ranks_and_cover_every_vision_token(vl_samples, world, seed):
    model, samples = vl_samples
    plan = random_plan_for({s: x.length for s, x in samples.items()}, world, min(world, 4), seed)
    layouts = _layouts(model, plan, samples)
    routes = [vision_route(model.config, plan, samples, layouts, r) for r in range(world)]
    for r in range(world):
        for o in range(world):
            assert routes[r].send_splits[o] == routes[o].recv_splits[r]
    vision_ids = torch.tensor([model.config.image_token_id, model.config.video_token_id])
    for r, layout in enumerate(layouts):
        local_ids = layout.slice_tokens({s: x.input_ids for s, x in samples.items()})
        expected = torch.isin(local_ids, vision_ids).nonzero().flatten()
        assert sorted(routes[r].recv_local_index.tolist()) == expected.tolist()
    patches = routes[0].patches_per_rank
    assert max(patches) - min(patches) <= max(u.num_patches for r in routes for u in r.my_units)


def test_exchange_emulated_over_all_ranks_equals_hf_vision_embeddings(vl_samples):
    """Every rank encodes only its units; rows routed by the route land exactly where HF puts them."""
    model, samples = vl_samples
    _emulate_and_check(model, samples, seed=7)


def test_shared_media_is_encoded_once_and_reaches_every_sample(vl_samples):
    """GRPO: the samples of one prompt carry the same media; with share keys it is encoded once."""
    import dataclasses

    model, samples = vl_samples
    shared = {}
    for seq_id, sample in samples.items():
        items = [dataclasses.replace(item, share_key=f"{seq_id}/{k}") for k, item in enumerate(sample.items)]
        for copy in ("a", "b"):
            shared[f"{seq_id}-{copy}"] = dataclasses.replace(sample, id=f"{seq_id}-{copy}", items=items)
    routes = _emulate_and_check(model, shared, seed=2)
    total = sum(i.num_patches for s in samples.values() for i in s.items)
    assert sum(routes[0].patches_per_rank) == total  # not 2x: each shared item once


def test_exchange_refuses_a_group_of_another_size_than_the_routes_domain():
    """A route over a 4-rank SP domain needs a 4-rank group; without one (here: no process group at
    all, as the world group of a 2-domain job would also mismatch) it raises instead of exchanging."""
    empty = torch.zeros(0, dtype=torch.long)

    def route(num_ranks):
        return VisionRoute((), empty, (0,) * num_ranks, (0,) * num_ranks, empty, (0,) * num_ranks)

    assert exchange_group_size(route(1), None) == 1  # a domain of one rank exchanges nothing
    with pytest.raises(ValueError, match="SP domain of 4 ranks but its process group has 1.*domain_group"):
        exchange_group_size(route(4), None)


def _emulate_and_check(model, samples, seed):
    world = 4
    plan = random_plan_for({s: x.length for s, x in samples.items()}, world, 4, seed=seed)
    layouts = _layouts(model, plan, samples)
    routes = [vision_route(model.config, plan, samples, layouts, r) for r in range(world)]
    items = {s: x.items for s, x in samples.items()}
    visual = model.model.visual
    with torch.no_grad():
        sent = []
        for route in routes:
            pixels = torch.cat([unit_pixels(u, items[u.seq_id][u.item_index]) for u in route.my_units])
            grids = torch.tensor([[1, *u.grid_hw] for u in route.my_units])
            merged = visual(pixels, grid_thw=grids).pooler_output
            rows = merged[route.send_index]
            sent.append(list(torch.split(rows, list(route.send_splits))))
        reference = {}
        for seq_id, sample in samples.items():
            embeds = model.get_input_embeddings()(sample.input_ids)
            kwargs = reference_inputs(model, sample)
            if "pixel_values" in kwargs:
                image = torch.cat(model.model.get_image_features(kwargs["pixel_values"],
                                                                 kwargs["image_grid_thw"]).pooler_output)
                embeds[sample.input_ids == model.config.image_token_id] = image
            if "pixel_values_videos" in kwargs:
                video = torch.cat(model.model.get_video_features(kwargs["pixel_values_videos"],
                                                                 kwargs["video_grid_thw"]).pooler_output)
                embeds[sample.input_ids == model.config.video_token_id] = video
            reference[seq_id] = embeds
    for o, (route, layout) in enumerate(zip(routes, layouts)):
        received = torch.cat([sent[r][o] for r in range(world)])
        expected = layout.slice_tokens(reference, dim=0)[route.recv_local_index]
        torch.testing.assert_close(received, expected, atol=1e-5, rtol=1e-5)
    return routes


def test_bench_vision_policies_encode_the_same_patches(tmp_path):
    from flexrl_ds.bench.vision_balance_bench import run
    from flexrl_ds.cli.main import main

    rows = run("image-heavy", num_prompts=8, n_samples=4, world_size=8, p_max=4, seed=1)
    by_policy = {row.policy: row for row in rows}
    assert len({round(row.mean_patches, 6) for row in rows}) == 1  # same total work, only placed differently
    assert by_policy["domain"].max_patches <= by_policy["pack-group"].max_patches
    assert by_policy["domain"].max_patches <= by_policy["sequence-owner"].max_patches
    assert main(["bench", "vision", "--gbs", "4", "--n-samples", "2", "--world", "4", "--p-max", "4",
                 "--plot", str(tmp_path / "v.png")]) == 0
    assert (tmp_path / "v.png").stat().st_size > 0
