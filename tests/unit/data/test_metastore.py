"""MetaStore bookkeeping (pure; refs are opaque strings here)."""

from __future__ import annotations

import pytest

from flexrl_ds.loader.metastore import MetaStore, PromptEntry, PromptKey, SampleId, SliceKey, make_layout


def _entry(step, slot, kinds=(("video", (5, 2, 2)),), groups_per_chunk=2):
    layouts = tuple(make_layout(i, kind, grid, groups_per_chunk) for i, (kind, grid) in enumerate(kinds))
    return PromptEntry(PromptKey(step, slot), f"rec-{step}-{slot}", layouts, cost=1.0)


def test_layouts_cut_videos_into_chunks_and_keep_images_whole():
    video = make_layout(0, "video", (5, 2, 3), groups_per_chunk=2)
    assert video.chunks == ((0, 2), (2, 4), (4, 5)) and video.rows_per_group == 6 and video.num_patches == 30
    assert video.chunks_for(1, 3) == [0, 1]
    image = make_layout(1, "image", (1, 4, 4), groups_per_chunk=2)
    assert image.chunks == ((0, 1),)


def test_samples_of_one_prompt_share_its_entry_and_slices():
    store = MetaStore(num_samples_per_prompt=4)
    store.add(_entry(0, 0, kinds=(("image", (1, 2, 2)), ("video", (3, 2, 2)))))
    store.route(PromptKey(0, 0), "actor-1", "ref-a")
    entries = {id(store.lookup(SampleId(0, 0, k))) for k in range(4)}
    assert len(entries) == 1
    assert store.owner_of(SampleId(0, 0, 3)) == "actor-1"
    assert store.entry(PromptKey(0, 0)).slice_keys() == [
        SliceKey(PromptKey(0, 0), 0, 0), SliceKey(PromptKey(0, 0), 1, 0), SliceKey(PromptKey(0, 0), 1, 1)
    ]
    with pytest.raises(KeyError, match="sample_index"):
        store.lookup(SampleId(0, 0, 4))


def test_rerouting_moves_ownership_and_counts_generations():
    store = MetaStore()
    for slot in range(3):
        store.add(_entry(0, slot))
        store.route(PromptKey(0, slot), f"actor-{slot % 2}", f"ref-{slot}")
    assert store.owned_by("actor-0") == [PromptKey(0, 0), PromptKey(0, 2)]
    entry = store.route(PromptKey(0, 2), "actor-1", "ref-2b")
    assert entry.generation == 2 and entry.task_ref == "ref-2b"
    assert store.owned_by("actor-0") == [PromptKey(0, 0)]
    assert store.owned_by("actor-1") == [PromptKey(0, 1), PromptKey(0, 2)]


def test_release_step_forgets_only_that_step():
    store = MetaStore()
    for step in range(2):
        for slot in range(2):
            store.add(_entry(step, slot))
            store.route(PromptKey(step, slot), f"actor-{slot}", "ref")
    released = store.release_step(0)
    assert released == {"actor-0": [PromptKey(0, 0)], "actor-1": [PromptKey(0, 1)]}
    assert store.keys() == [PromptKey(1, 0), PromptKey(1, 1)]
    with pytest.raises(KeyError, match="released"):
        store.entry(PromptKey(0, 0))
