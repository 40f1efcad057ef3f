"""ShadowLoader controller and worker logic without Ray: fake preprocessor, fake refs."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from flexrl_ds.loader.actors import DecodeFailure, SliceMaker, item_layouts
from flexrl_ds.loader.central_loader import CentralLoader
from flexrl_ds.loader.config import LoaderConfig, PoolConfig
from flexrl_ds.loader.materializer import Materializer, SliceRequest
from flexrl_ds.loader.metastore import PromptKey, make_layout
from flexrl_ds.loader.proxy_loader import ProxyLoader, requests_for_samples
from flexrl_ds.media.bad_records import EpochOrder
from flexrl_ds.media.preprocess import ItemTensors
from flexrl_ds.media.types import BadMediaError, BadRecord, ItemMeta, MediaInfo, MediaItem, Record, SampleMeta


def _record(index, kinds):
    items = tuple(MediaItem(kind, f"/fake/{index}-{k}") for k, kind in enumerate(kinds))
    return Record(id=f"rec-{index}", prompt="<x>" * len(kinds), items=items, index=index)


class FakePreprocessor:
    """Probe: videos get 5 temporal groups, images 1; records whose id ends in 'bad' are bad.
    Materialize: deterministic pixels derived from (record index, item, row)."""

    def probe(self, record):
        if "bad" in record.id:
            return BadRecord(record.id, "missing file", record.index)
        items = tuple(
            ItemMeta(item, MediaInfo(56, 56), (56, 56), (5 if item.kind == "video" else 1, 2, 3), patch_dim=4)
            for item in record.items
        )
        return SampleMeta(record.id, record, items)

    def materialize(self, meta, items=None):
        out = {}
        for index, item in enumerate(meta.items):
            rows = item.num_patches
            base = meta.record.index * 1000 + index * 100
            pixels = (torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + base)
            out[index] = ItemTensors(pixels, torch.tensor(item.grid_thw))
        return out


def _records(num, bad=()):
    records = [_record(i, ("video",) if i % 2 else ("image", "video")) for i in range(num)]
    for i in bad:
        records[i] = Record(id=f"rec-{i}-bad", prompt="<image>", items=(MediaItem("image", "/x"),), index=i)
    return records


class FakePool:
    """Synchronous stand-in for PreprocessPool: refs are dict keys into `objects`."""

    def __init__(self, names=("a", "b")):
        self.maker = SliceMaker(FakePreprocessor)
        self.alive, self.objects, self.submitted = list(names), {}, []
        self.config = PoolConfig(timeout_s=10)

    lost_errors = ()

    def task_result(self, task_ref):
        return self.objects[task_ref]

    def probe(self, records):
        return self.maker.probe(records)

    def submit(self, key, meta, layouts, cost):
        owner = self.alive[len(self.submitted) % len(self.alive)]
        slices = self.maker.make_slices(key, meta, layouts)
        slice_refs = {}
        for slice_key, value in slices.items():
            ref = f"obj:{owner}:{key}:{slice_key.item_index}:{slice_key.chunk_index}:{len(self.submitted)}"
            self.objects[ref] = value
            slice_refs[slice_key] = ref
        task_ref = f"task:{owner}:{key}:{len(self.submitted)}"
        self.objects[task_ref] = slice_refs
        self.submitted.append((key, owner))
        return owner, task_ref

    def mark_dead(self, name):
        self.alive.remove(name)

    def release(self, released):
        pass


class Lost(Exception):
    pass


class FakeFetcher:
    lost_errors = (Lost,)

    def __init__(self, objects, dead=(), gate=None):
        self.objects, self.dead, self.gate = objects, set(dead), gate

    def get(self, refs):
        if self.gate is not None:
            self.gate.wait(10)
        if any(ref.split(":")[1] in self.dead for ref in refs):
            raise Lost(refs)
        return [self.objects[ref] for ref in refs]


def test_record_order_is_seeded_and_covers_each_epoch():
    first, again = EpochOrder(10, seed=3, shuffle=True), EpochOrder(10, seed=3, shuffle=True)
    windows = [first.take(4) for _ in range(2)]
    assert windows == [again.take(4) for _ in range(2)]
    assert len(set(windows[0] + windows[1])) == 8
    assert first.take(4) and first.epoch == 1  # only 2 rows left: next epoch
    assert EpochOrder(10, seed=4, shuffle=True).take(10) != EpochOrder(10, seed=3, shuffle=True).take(10)


@pytest.mark.parametrize("policy", ["skip", "replace"])
def test_bad_records_are_reported_and_never_shift_other_steps(policy):
    config = LoaderConfig(global_batch=3, lookahead_steps=0, shuffle=False)
    clean = ProxyLoader(_records(12), FakePool(), config, bad_record_policy=policy)
    dirty = ProxyLoader(_records(12, bad=(1,)), FakePool(), config, bad_record_policy=policy)
    clean_steps = [clean.next_step() for _ in range(3)]
    dirty_steps = [dirty.next_step() for _ in range(3)]
    assert [b.id for b in dirty_steps[0].bad_records] == ["rec-1-bad"]
    ids = [p.meta.id for p in dirty_steps[0].prompts]
    if policy == "skip":
        assert ids == ["rec-0", "rec-2"] and dirty_steps[0].replacements == {}
    else:  # the last row of the epoch stands in, marked as such
        assert ids == ["rec-0", "rec-1-bad->rec-11", "rec-2"]
        assert dirty_steps[0].replacements == {"rec-1-bad": "rec-11"}
    for clean_step, dirty_step in zip(clean_steps[1:], dirty_steps[1:]):
        assert [p.meta.id for p in clean_step.prompts] == [p.meta.id for p in dirty_step.prompts]
    assert dirty.stats.num_bad == 1


def test_error_policy_names_the_record():
    loader = ProxyLoader(_records(6, bad=(0,)), FakePool(), LoaderConfig(global_batch=3, shuffle=False),
                         bad_record_policy="error")
    with pytest.raises(ValueError, match="rec-0-bad.*missing file"):
        loader.next_step()


def test_materializer_cuts_exact_group_ranges_and_shares_a_decode_between_samples():
    pool = FakePool()
    loader = ProxyLoader(_records(4), pool, LoaderConfig(global_batch=2, num_samples_per_prompt=3,
                                                         groups_per_chunk=2, shuffle=False))
    step = loader.next_step()
    loader.wait_composed()  # the look-ahead step is composed in the background
    assert len(step.sample_ids()) == 6
    assert len(pool.submitted) == 4  # step 0 and the look-ahead step 1: one task per prompt, not per sample
    video = PromptKey(0, 1)  # rec-1: a single video of 5 groups
    requests = [SliceRequest(video, 0, 1, 4), SliceRequest(video, 0, 4, 5), SliceRequest(PromptKey(0, 0), 0)]
    materializer = Materializer(FakeFetcher(pool.objects), repair=loader.repair, num_threads=2)
    materializer.prefetch(loader.assignment(step, requests))
    out = materializer.get(0)
    full = FakePreprocessor().materialize(step.prompts[1].meta)[0].pixel_values
    assert torch.equal(out.tensors[0]["pixel_values"], full[1 * 6 : 4 * 6]) and out.tensors[0]["grid_thw"] == (3, 2, 3)
    assert torch.equal(out.tensors[1]["pixel_values"], full[24:30])
    image = FakePreprocessor().materialize(step.prompts[0].meta)[0].pixel_values
    assert torch.equal(out.tensors[2]["pixel_values"], image)
    # only chunks covering groups 1..5 of the video (all 3 chunks) and the image were pulled
    assert out.bytes_fetched == (30 + 6) * 4 * 4


def test_prefetch_does_not_block_and_get_reports_the_wait():
    pool = FakePool()
    loader = ProxyLoader(_records(2), pool, LoaderConfig(global_batch=2, lookahead_steps=0))
    step = loader.next_step()
    gate = threading.Event()
    materializer = Materializer(FakeFetcher(pool.objects, gate=gate))
    started = time.perf_counter()
    materializer.prefetch(loader.assignment(step, requests_for_samples(step, step.sample_ids())))
    assert time.perf_counter() - started < 1.0
    threading.Timer(1.0, gate.set).start()  # well past the 0.2 s asserted below, also on a loaded machine
    out = materializer.get(0)
    assert out.wait_s >= 0.2 and len(out.tensors) == 3


def test_repair_reroutes_each_lost_prompt_once():
    pool = FakePool(names=("a", "b"))
    loader = ProxyLoader(_records(4), pool, LoaderConfig(global_batch=4, lookahead_steps=0, shuffle=False))
    step = loader.next_step()
    owned_by_a = loader.store.owned_by("a")
    assert owned_by_a
    fetcher = FakeFetcher(pool.objects, dead={"a"})
    materializer = Materializer(fetcher, repair=loader.repair, num_threads=4)
    requests = requests_for_samples(step, step.sample_ids())
    materializer.prefetch(loader.assignment(step, requests))
    out = materializer.get(0)
    assert loader.stats.num_rerouted == len(owned_by_a)
    assert len(pool.submitted) == 4 + len(owned_by_a)
    assert loader.store.owned_by("a") == [] and pool.alive == ["b"]
    assert out.num_repairs == len(owned_by_a)
    for request, tensors in zip(requests, out.tensors):
        meta = step.prompts[request.prompt.slot].meta
        assert torch.equal(tensors["pixel_values"], FakePreprocessor().materialize(meta)[request.item_index].pixel_values)


def test_central_loader_gives_the_same_steps_and_tensors_and_ships_pixels():
    config = LoaderConfig(global_batch=3, num_samples_per_prompt=2, seed=5)
    records = _records(9, bad=(4,))
    proxy = ProxyLoader(records, FakePool(), config, bad_record_policy="replace")
    central = CentralLoader(records, FakePreprocessor, config, bad_record_policy="replace")
    pool = proxy.pool
    for _ in range(2):
        a, b = proxy.next_step(), central.next_step()
        assert a.report() == b.report()
        requests = requests_for_samples(a, a.sample_ids())
        m_proxy, m_central = Materializer(FakeFetcher(pool.objects)), Materializer(FakeFetcher({}))
        m_proxy.prefetch(proxy.assignment(a, requests))
        m_central.prefetch(central.assignment(b, requests))
        for x, y in zip(m_proxy.get(a.step).tensors, m_central.get(b.step).tensors):
            assert torch.equal(x["pixel_values"], y["pixel_values"])
    pixel_bytes = central.stats.bytes_through_controller
    assert pixel_bytes > 0


def test_item_layouts_follow_the_meta():
    meta = FakePreprocessor().probe(_record(0, ("image", "video")))
    layouts = item_layouts(meta, groups_per_chunk=2)
    assert layouts == (make_layout(0, "image", (1, 2, 3), 2), make_layout(1, "video", (5, 2, 3), 2))
    assert layouts[1].chunks == ((0, 2), (2, 4), (4, 5))


class RedecodeFailsPool(FakePool):
    """FakePool whose second decode of a record in `failing` (a re-route) fails, like a file
    broken after the step was handed out."""

    def __init__(self, names=("a", "b")):
        super().__init__(names)
        self.failing: set[str] = set()

    def submit(self, key, meta, layouts, cost):
        if meta.id in self.failing and any(done == key for done, _ in self.submitted):
            owner = self.alive[len(self.submitted) % len(self.alive)]
            task_ref = f"task:{owner}:{key}:{len(self.submitted)}"
            self.objects[task_ref] = DecodeFailure(BadRecord(meta.id, "cannot decode image: truncated",
                                                             meta.record.index, stage="materialize"))
            self.submitted.append((key, owner))
            return owner, task_ref
        return super().submit(key, meta, layouts, cost)


def _step_with_a_broken_prompt(policy):
    """A handed-out step of 4 prompts (n=2); actor "a" is dead and the first prompt it owned
    fails to re-decode. Returns (pool, loader, step, requests, broken key)."""
    pool = RedecodeFailsPool()
    config = LoaderConfig(global_batch=4, num_samples_per_prompt=2, lookahead_steps=0, shuffle=False,
                          groups_per_chunk=2)
    loader = ProxyLoader(_records(6), pool, config, bad_record_policy=policy)
    step = loader.next_step()
    broken = loader.store.owned_by("a")[0]
    pool.failing.add(step.prompts[broken.slot].meta.id)
    return pool, loader, step, requests_for_samples(step, step.sample_ids()), broken


@pytest.mark.parametrize("policy", ["skip", "replace"])
def test_prompt_withdrawn_after_hand_out_is_marked_and_every_other_request_arrives_once(policy):
    pool, loader, step, requests, broken = _step_with_a_broken_prompt(policy)
    broken_id = step.prompts[broken.slot].meta.id
    materializer = Materializer(FakeFetcher(pool.objects, dead={"a"}), repair=loader.repair, num_threads=4,
                                bad_record_policy=policy)
    materializer.prefetch(loader.assignment(step, requests))
    out = materializer.get(step.step)  # no exception: the step comes back, the broken prompt marked

    assert list(out.withdrawn) == [broken] and out.withdrawn_reasons() == {broken_id: "cannot decode image: truncated"}
    assert step.withdrawn == {broken_id: "cannot decode image: truncated"} and loader.stats.num_withdrawn == 1
    assert out.requests == tuple(requests) and len(out.tensors) == len(requests)
    assert [t is None for t in out.tensors] == [r.prompt == broken for r in requests]
    delivered = out.delivered()
    assert [r for r, _ in delivered] == [r for r in requests if r.prompt != broken]  # each once, in order
    for request, tensors in delivered:
        meta = step.prompts[request.prompt.slot].meta
        reference = FakePreprocessor().materialize(meta)[request.item_index].pixel_values
        assert torch.equal(tensors["pixel_values"], reference), request
    assert step.replacements == {}  # no substitute after hand-out, even under replace

    # a worker fetching after the repair (no repair of its own) sees the same withdrawal
    late = Materializer(FakeFetcher(pool.objects), bad_record_policy=policy)
    late.prefetch(loader.assignment(step, requests))
    assert late.get(step.step).withdrawn_reasons() == out.withdrawn_reasons()
    assert loader.stats.num_withdrawn == 1 and loader.stats.num_bad == 1  # decided once, by the loader


def test_prompt_failing_after_hand_out_under_error_policy_raises_naming_the_record():
    pool, loader, step, requests, broken = _step_with_a_broken_prompt("error")
    broken_id = step.prompts[broken.slot].meta.id
    materializer = Materializer(FakeFetcher(pool.objects, dead={"a"}), repair=loader.repair, num_threads=4,
                                bad_record_policy="error")
    materializer.prefetch(loader.assignment(step, requests))
    with pytest.raises(ValueError, match=f"record {broken_id!r}: cannot decode image"):
        materializer.get(step.step)
    assert step.withdrawn == {}
    # a worker that fetches the failed re-decode without repairing raises too, naming the record
    late = Materializer(FakeFetcher(pool.objects), bad_record_policy="error")
    late.prefetch(loader.assignment(step, requests))
    with pytest.raises(BadMediaError, match=f"record {broken_id!r}: cannot decode image"):
        late.get(step.step)


def test_materializer_policy_is_checked():
    with pytest.raises(ValueError, match="bad_record_policy"):
        Materializer(FakeFetcher({}), bad_record_policy="drop")


def test_logprobs_rank_fetch_fails_loudly_naming_a_withdrawn_prompt():
    """`flexrl logprobs` cannot drop a prompt from a planned step: it stops, naming the record."""
    from flexrl_ds.runtime.rank_pixels import RankPixels

    pool, loader, step, requests, broken = _step_with_a_broken_prompt("skip")
    materializer = Materializer(FakeFetcher(pool.objects, dead={"a"}), repair=loader.repair)
    materializer.prefetch(loader.assignment(step, requests))
    rank = RankPixels.__new__(RankPixels)  # its Ray set-up skipped: only the hand-over is tested
    rank.step, rank.prompt_keys, rank.units = step.step, {}, ()
    rank.requests, rank.materializer = requests, materializer
    broken_id = step.prompts[broken.slot].meta.id
    with pytest.raises(ValueError, match=f"record {broken_id!r}: cannot decode.*cannot drop a prompt"):
        rank.items({}, ())
