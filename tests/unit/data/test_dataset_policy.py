"""One bad-record policy: offline path (dataset.apply_policy) == loader's step composition
(proxy_loader.StepSource); properties of `replace`; decode failures before and after hand-out.
No Ray, no media: fake records whose probe is a pure function of the record."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flexrl_ds.loader.actors import DecodeFailure, SliceMaker
from flexrl_ds.loader.config import LoaderConfig, PoolConfig
from flexrl_ds.loader.materializer import Materializer
from flexrl_ds.loader.proxy_loader import ProxyLoader, StepSource, requests_for_samples
from flexrl_ds.media.bad_records import BadRecordPolicy, EpochOrder, original_id
from flexrl_ds.media.dataset import apply_policy
from flexrl_ds.media.preprocess import ItemTensors
from flexrl_ds.media.types import BadMediaError, BadRecord, ItemMeta, MediaInfo, MediaItem, Record, SampleMeta


def _records(num: int, bad: set[int]) -> list[Record]:
    return [Record(id=f"r{i}" + ("-bad" if i in bad else ""), prompt="<image>",
                   items=(MediaItem("image", f"/fake/{i}.png"),), index=i) for i in range(num)]


def _probe_one(record: Record):
    if record.id.endswith("-bad"):
        return BadRecord(record.id, f"missing file /fake/{record.index}.png", record.index)
    return SampleMeta(record.id, record, (ItemMeta(record.items[0], MediaInfo(56, 56), (56, 56), (1, 2, 2), 4),))


def _probe(records):
    return [_probe_one(record) for record in records]


def _loader_steps(records, config: LoaderConfig, num_steps: int, policy: str):
    source = StepSource(records, config, _probe, bad_record_policy=policy)
    return [source.compose() for _ in range(num_steps)], source


@pytest.mark.parametrize("shuffle, seed, batch", [(False, 0, 3), (True, 7, 4), (True, 1, 5)])
@pytest.mark.parametrize("policy", ["skip", "replace"])
def test_offline_and_loader_compose_the_same_steps(policy, shuffle, seed, batch):
    records = _records(23, bad={0, 4, 5, 11, 17, 22})
    offline = apply_policy(_probe(records), policy, global_batch=batch, seed=seed, shuffle=shuffle)
    config = LoaderConfig(global_batch=batch, seed=seed, shuffle=shuffle)
    steps, source = _loader_steps(records, config, len(offline.steps), policy)
    assert [[p.meta.id for p in step.prompts] for step in steps] == [[m.id for m in s] for s in offline.steps]
    replacements = {bad: sub for step in steps for bad, sub in step.replacements.items()}
    assert replacements == offline.replacements
    assert [b.id for step in steps for b in step.bad_records] == [b.id for b in offline.report.bad_records]
    assert source.stats.num_bad == offline.counts.num_bad
    assert source.stats.num_replaced == offline.counts.num_replaced == len(replacements)
    if policy == "replace":
        assert replacements  # the case is exercised


def test_error_policy_names_the_record_on_both_paths():
    records = _records(6, bad={2})
    with pytest.raises(ValueError, match=r"step 0: record 'r2-bad': missing file /fake/2.png"):
        apply_policy(_probe(records), "error", global_batch=3)
    source = StepSource(records, LoaderConfig(global_batch=3, shuffle=False), _probe, bad_record_policy="error")
    with pytest.raises(ValueError, match=r"step 0: record 'r2-bad': missing file /fake/2.png"):
        source.compose()
    assert source.stats.num_bad == 1


@settings(max_examples=60, deadline=None)
@given(num=st.integers(4, 30), data=st.data())
def test_replace_never_duplicates_and_reports_exactly_what_is_trained(num, data):
    bad = set(data.draw(st.lists(st.integers(0, num - 1), max_size=num)))
    batch = data.draw(st.integers(1, num))
    seed = data.draw(st.integers(0, 5))
    records = _records(num, bad)
    steps, _ = _loader_steps(records, LoaderConfig(global_batch=batch, seed=seed), num // batch, "replace")
    used: dict[int, list[str]] = {}
    for step in steps:
        ids = [p.meta.id for p in step.prompts]
        trained = [p.meta.record.id for p in step.prompts]
        assert len(set(trained)) == len(trained)  # nothing twice within a step
        assert not any(record.endswith("-bad") for record in trained)
        for sample_id, record_id in zip(ids, trained):  # every substitute is reported, and only those
            if "->" in sample_id:
                assert step.replacements[original_id(sample_id)] == record_id
        assert len(step.replacements) == sum("->" in i for i in ids)
        reported = {b.id for b in step.bad_records}
        assert all(original_id(i) in reported for i in ids if "->" in i)
        used.setdefault(step.epoch, []).extend(trained)
    for trained_in_epoch in used.values():  # nothing twice within an epoch either
        assert len(set(trained_in_epoch)) == len(trained_in_epoch)


def test_skip_keeps_every_other_step_window():
    clean = StepSource(_records(12, set()), LoaderConfig(global_batch=3, seed=2), _probe)
    dirty = StepSource(_records(12, {7}), LoaderConfig(global_batch=3, seed=2), _probe, bad_record_policy="replace")
    clean_steps = [[p.meta.record.index for p in clean.compose().prompts] for _ in range(3)]
    dirty_steps = [dirty.compose() for _ in range(3)]
    hit = next(i for i, step in enumerate(dirty_steps) if step.bad_records)
    for index, step in enumerate(dirty_steps):
        if index != hit:
            assert [p.meta.record.index for p in step.prompts] == clean_steps[index]


def test_decode_failure_before_hand_out_gives_the_same_substitute_on_both_paths():
    records = _records(11, bad={1})
    offline = apply_policy(_probe(records), "replace", global_batch=3)  # [r0, r1-bad->r10, r2], 3 steps
    failed = offline.steps[0][1]  # the substitute r10 fails to decode in its turn; r9 is still unused
    bad = BadRecord("r10", "cannot decode frames", 10, "materialize")
    offline.resolve_failure(failed, bad)
    source = StepSource(records, LoaderConfig(global_batch=3, shuffle=False), _probe, bad_record_policy="replace")
    step = source.settle(source.compose(), lambda prompt: bad if prompt.meta.record.id == "r10" else None)
    assert [p.meta.id for p in step.prompts] == [m.id for m in offline.steps[0]] == ["r0", "r1-bad->r9", "r2"]
    assert step.replacements == offline.replacements == {"r1-bad": "r9"}
    assert [b.id for b in step.bad_records] == ["r1-bad", "r10"]
    assert source.stats.num_bad == offline.counts.num_bad == 2


def test_policy_runs_out_of_rows_under_replace():
    order = EpochOrder(3, shuffle=False)
    entries = _probe(_records(3, {0, 1, 2}))
    policy = BadRecordPolicy("replace", order, lambda rows: [entries[r] for r in rows])
    epoch, samples, report = policy.compose(0, 3)
    assert samples == [] and [b.id for b in report.bad_records] == ["r0-bad", "r1-bad", "r2-bad"]
    assert (policy.counts.num_bad, policy.counts.num_unreplaced, policy.counts.num_replaced) == (3, 3, 0)


# --- decode failures found after the step was handed out -------------------------------------


class Lost(Exception):
    pass


class _Preprocessor:
    """Fake decode: deterministic pixels; records in `broken` fail (a file gone after probing)."""

    broken: set[str] = set()

    def probe(self, record):
        return _probe_one(record)

    def materialize(self, meta, items=None):
        if meta.record.id in self.broken:
            raise BadMediaError(BadRecord(meta.record.id, "image 0 (x.png): file vanished", meta.record.index,
                                          "materialize"))
        return {0: ItemTensors(torch.full((4, 4), float(meta.record.index)), torch.tensor((1, 2, 2)))}


class _Pool:
    """Synchronous stand-in for PreprocessPool with actor death: refs of a dead actor are lost."""

    lost_errors = (Lost,)

    def __init__(self):
        self.maker = SliceMaker(_Preprocessor)
        self.alive, self.dead, self.objects, self.num_submitted = ["a", "b"], set(), {}, 0
        self.config = PoolConfig(timeout_s=10)

    def probe(self, records):
        return self.maker.probe(records)

    def submit(self, key, meta, layouts, cost):
        owner = self.alive[self.num_submitted % len(self.alive)]
        self.num_submitted += 1
        task = f"task:{owner}:{self.num_submitted}"
        try:
            slices = self.maker.make_slices(key, meta, layouts)
        except BadMediaError as error:
            self.objects[task] = DecodeFailure(error.bad)
            return owner, task
        refs = {}
        for slice_key, value in slices.items():
            refs[slice_key] = f"obj:{owner}:{self.num_submitted}:{slice_key.item_index}:{slice_key.chunk_index}"
            self.objects[refs[slice_key]] = value
        self.objects[task] = refs
        return owner, task

    def task_result(self, ref):
        return self.get([ref])[0]

    def get(self, refs):  # also the workers' fetcher
        if any(ref.split(":")[1] in self.dead for ref in refs):
            raise Lost(refs)
        return [self.objects[ref] for ref in refs]

    def mark_dead(self, name):
        self.alive.remove(name)

    def release(self, released):
        pass


class _Fetcher:
    def __init__(self, pool):
        self.pool, self.lost_errors = pool, (Lost,)

    def get(self, refs):
        return self.pool.get(refs)


def _handed_out_step(policy: str):
    _Preprocessor.broken = set()
    pool = _Pool()
    loader = ProxyLoader(_records(6, set()), pool, LoaderConfig(global_batch=4, shuffle=False, lookahead_steps=0),
                         bad_record_policy=policy)
    step = loader.next_step()
    assert [p.meta.id for p in step.prompts] == ["r0", "r1", "r2", "r3"] and not step.bad_records
    victim = loader.store.entry(step.prompts[0].key).owner
    lost = [p.meta.id for p in step.prompts if loader.store.entry(p.key).owner == victim]
    pool.dead.add(victim)  # the actor dies after hand-out, its cached slices with it ...
    _Preprocessor.broken = {lost[0]}  # ... and one of its records no longer decodes anywhere
    return loader, pool, step, lost


@pytest.mark.parametrize("policy", ["skip", "replace"])
def test_failure_found_by_a_worker_after_hand_out_is_withdrawn_once(policy):
    loader, pool, step, lost = _handed_out_step(policy)
    requests = requests_for_samples(step, step.sample_ids())
    workers = [Materializer(_Fetcher(pool), repair=loader.repair, num_threads=2) for _ in range(2)]
    for worker in workers:
        worker.prefetch(loader.assignment(step, requests))
    for worker in workers:  # whichever worker finds it, the step comes back with the record marked
        out = worker.get(step.step)
        assert out.withdrawn_reasons() == {lost[0]: "image 0 (x.png): file vanished"}
        for request, tensors in out.delivered():
            assert torch.equal(tensors["pixel_values"], torch.full((4, 4), float(request.prompt.slot)))
    assert step.withdrawn == {lost[0]: "image 0 (x.png): file vanished"}
    assert [(b.id, b.stage) for b in step.bad_records] == [(lost[0], "materialize")]
    assert step.report()["prompts"] == ["r0", "r1", "r2", "r3"]  # shapes were planned: slot kept, not trained
    assert (loader.stats.num_withdrawn, loader.stats.num_bad, loader.stats.num_replaced) == (1, 1, 0)
    # the other prompts of the dead actor were re-routed once and decode fine
    assert loader.stats.num_rerouted == len(lost)
    good = [r for r in requests if step.prompts[r.prompt.slot].meta.id not in step.withdrawn]
    worker = Materializer(_Fetcher(pool), repair=loader.repair)
    worker.prefetch(loader.assignment(step, good))
    out = worker.get(step.step)
    for request, tensors in zip(good, out.tensors):
        assert torch.equal(tensors["pixel_values"], torch.full((4, 4), float(request.prompt.slot)))


def test_failure_after_hand_out_raises_under_error_policy():
    loader, pool, step, lost = _handed_out_step("error")
    source = loader.assignment(step, requests_for_samples(step, step.sample_ids())).sources[step.prompts[0].key]
    with pytest.raises(ValueError, match=f"step 0: record '{lost[0]}': image 0 \\(x.png\\): file vanished"):
        loader.repair(source.key, source.generation)
    assert loader.stats.num_bad == 1 and step.withdrawn == {}


def test_concurrent_repairs_of_one_failure_record_it_once():
    loader, pool, step, lost = _handed_out_step("skip")
    key = next(p.key for p in step.prompts if p.meta.id == lost[0])
    generation = loader.store.entry(key).generation
    threads = [threading.Thread(target=loader.repair, args=(key, generation)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert step.withdrawn.keys() == {lost[0]} and len(step.bad_records) == 1
    assert loader.stats.num_withdrawn == 1 and loader.stats.num_rerouted == len(lost)


def test_substitute_after_look_ahead_started_the_next_epoch_is_not_already_in_the_step():
    """Steps of 2 over 6 rows in file order: step 2 = rows 4, 5 ends epoch 0; look-ahead composes
    step 3 (epoch 1) before step 2 settles. r5 then fails to decode: epoch 1's tail is row 5, then
    4 — both already drawn by step 2 — so the substitute is row 3."""
    records = _records(6, set())
    source = StepSource(records, LoaderConfig(global_batch=2, shuffle=False), _probe, bad_record_policy="replace")
    steps = [source.compose() for _ in range(4)]
    assert [s.epoch for s in steps] == [0, 0, 0, 1]
    bad = BadRecord("r5", "cannot decode frames", 5, "materialize")
    settled = source.settle(steps[2], lambda prompt: bad if prompt.meta.record.id == "r5" else None)
    assert [p.meta.id for p in settled.prompts] == ["r4", "r5->r3"] and settled.rows == [4, 5, 3]
    later = source.compose()  # epoch 1 goes on with rows 2, 4 (the skipped rows stay unused)
    assert [p.meta.id for p in later.prompts] == ["r2", "r4"] and later.epoch == 1


def test_reserve_skips_excluded_rows_and_keeps_them_unused():
    order = EpochOrder(6, shuffle=False)
    assert order.take(2) == [0, 1]
    assert order.reserve(exclude={5, 4}) == 3
    assert order.num_unused == 3
    assert order.take(3) == [2, 4, 5]  # the skipped rows are still visited
    assert order.reserve() is None
