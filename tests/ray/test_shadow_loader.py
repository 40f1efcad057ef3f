"""ShadowLoader on a real local Ray cluster with real (tiny) media.

References are independent: the data subsystem's `SamplePreprocessor.materialize` run directly in
the test process on the same `SampleMeta`.
"""

from __future__ import annotations

import functools
import numpy as np
import pytest
import ray
import torch
from ray_helpers import wait_until_lost

from flexrl_ds.bench.loader_media import MediaDatasetSpec, write_media_dataset
from flexrl_ds.loader.actors import PreprocessPool
from flexrl_ds.loader.central_loader import CentralLoader
from flexrl_ds.loader.config import LoaderConfig, PoolConfig
from flexrl_ds.loader.materializer import Materializer, RayFetcher, SliceRequest
from flexrl_ds.loader.proxy_loader import ProxyLoader, requests_for_samples
from flexrl_ds.media.config import MediaConfig
from flexrl_ds.media.preprocess import SamplePreprocessor
from flexrl_ds.media.records import read_dataset

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

DATA_CONFIG = MediaConfig(video_min_pixels=28 * 28 * 4, video_max_pixels=28 * 28 * 16, video_fps=4.0)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    path = write_media_dataset(tmp_path_factory.mktemp("media"),
                               MediaDatasetSpec(num_videos=4, num_images=2, num_bad=1, num_corrupt_frames=1,
                                                video_seconds=3.0))
    return read_dataset(path)


# a partial of an importable class: actors unpickle it without importing this test module
_make_preprocessor = functools.partial(SamplePreprocessor, DATA_CONFIG)


def _reference(meta, request):
    pixels = SamplePreprocessor(DATA_CONFIG).materialize(meta, [request.item_index])[request.item_index].pixel_values
    grid_t, grid_h, grid_w = meta.items[request.item_index].grid_thw
    stop = grid_t if request.t_stop is None else request.t_stop
    return pixels[request.t_start * grid_h * grid_w : stop * grid_h * grid_w]


def _check_step(step, requests, out):
    metas = {prompt.key: prompt.meta for prompt in step.prompts}
    for request, tensors in zip(requests, out.tensors):
        assert torch.equal(tensors["pixel_values"], _reference(metas[request.prompt], request)), request


@pytest.fixture(scope="module")
def shared_pool(ray_session):
    pool = PreprocessPool(_make_preprocessor, PoolConfig(num_actors_per_node=3, num_cpus_per_actor=0.5))
    yield pool
    pool.shutdown()


def test_workers_get_exact_slices_from_actors_with_one_decode_per_prompt(shared_pool, records):
    pool = shared_pool
    decoded_before = sum(stats["num_decoded"] for stats in pool.stats())
    config = LoaderConfig(global_batch=3, num_samples_per_prompt=2, seed=1, groups_per_chunk=2)
    loader = ProxyLoader(records, pool, config, bad_record_policy="skip")
    workers = [Materializer(RayFetcher(timeout_s=60), repair=loader.repair) for _ in range(2)]
    pixel_bytes, num_prompts = 0, 0
    for _ in range(2):
        step = loader.next_step()
        num_prompts += len(step.prompts)
        samples = step.sample_ids()
        # sample k of every prompt goes to worker k: both workers need every prompt
        shares = [requests_for_samples(step, samples[k::2]) for k in range(2)]
        video = next(p for p in step.prompts if p.meta.items and p.meta.items[0].kind == "video")
        shares[1] = shares[1] + [SliceRequest(video.key, 0, 1, 3)]  # a planner-style frame range
        for worker, share in zip(workers, shares):
            worker.prefetch(loader.assignment(step, share))
        for worker, share in zip(workers, shares):
            out = worker.get(step.step)
            _check_step(step, share, out)
            pixel_bytes += out.bytes_fetched
        loader.release(step)
    num_decoded = sum(stats["num_decoded"] for stats in pool.stats()) - decoded_before
    # the look-ahead step is dispatched too; samples never cause extra decodes
    assert num_prompts <= num_decoded <= num_prompts + config.global_batch
    assert loader.stats.bytes_through_controller < 0.05 * pixel_bytes


def test_central_baseline_trains_on_the_same_samples_with_the_same_tensors(shared_pool, records):
    pool = shared_pool
    config = LoaderConfig(global_batch=4, seed=2)
    proxy = ProxyLoader(records, pool, config, bad_record_policy="replace")
    central = CentralLoader(records, _make_preprocessor, config, bad_record_policy="replace")
    a, b = proxy.next_step(), central.next_step()
    assert a.report() == b.report()
    requests = requests_for_samples(a, a.sample_ids())
    m_proxy, m_central = Materializer(RayFetcher(60)), Materializer(RayFetcher(60))
    m_proxy.prefetch(proxy.assignment(a, requests))
    m_central.prefetch(central.assignment(b, requests))
    for x, y in zip(m_proxy.get(a.step).tensors, m_central.get(b.step).tensors):
        assert torch.equal(x["pixel_values"], y["pixel_values"])
    assert central.stats.bytes_through_controller > 100 * proxy.stats.bytes_through_controller


def test_decode_failure_after_a_good_probe_is_reported_and_handled_by_the_policy(shared_pool, records):
    """Rows in file order: video-0000..0003, corrupt-0000 (header fine, frames zeroed), image-0000,
    image-0001, missing-0000. A window of 5 holds the corrupt video; replacements come from the tail."""
    expected_videos = [f"video-{i:04d}" for i in range(4)]
    for policy, last in (("skip", None), ("replace", "corrupt-0000->image-0001")):
        config = LoaderConfig(global_batch=5, shuffle=False)
        proxy = ProxyLoader(records, shared_pool, config, bad_record_policy=policy)
        central = CentralLoader(records, _make_preprocessor, config, bad_record_policy=policy)
        step = proxy.next_step()
        report = step.report()
        assert report == central.next_step().report()  # same samples whichever loader decodes
        stages = {bad["id"]: bad["stage"] for bad in report["bad_records"]}
        assert stages["corrupt-0000"] == "materialize"
        assert "decode" in next(b["reason"] for b in report["bad_records"] if b["id"] == "corrupt-0000")
        assert report["prompts"] == expected_videos + ([last] if last else [])
        assert report["replacements"] == ({"corrupt-0000": "image-0001"} if last else {})
        assert proxy.stats.num_bad == len(report["bad_records"]) == (1 if policy == "skip" else 2)
        requests = requests_for_samples(step, step.sample_ids())
        worker = Materializer(RayFetcher(timeout_s=60), repair=proxy.repair)
        worker.prefetch(proxy.assignment(step, requests))
        _check_step(step, requests, worker.get(step.step))
        proxy.release(step)
        proxy.close()
        worker.close()


def test_killing_an_actor_mid_step_loses_and_duplicates_nothing(shared_pool, records):
    """Runs last: it kills two of the shared pool's three actors."""
    pool = shared_pool
    pool.set_decode_delay(1.0)  # keep work queued on every actor
    config = LoaderConfig(global_batch=5, num_samples_per_prompt=2, seed=3)
    loader = ProxyLoader(records, pool, config, bad_record_policy="skip")
    step = loader.next_step()  # step 0 decoded; the look-ahead step 1 is composed in the background
    loader.wait_composed()  # ... and now queued on the actors
    victim = loader.store.owner_of(step.sample_ids()[0])
    unfinished = [key for key in loader.store.owned_by(victim)
                  if not ray_wait_done(loader.store.entry(key).task_ref)]
    assert unfinished, "the victim finished all its work before being killed: not mid-step"
    pool.kill(victim)
    worker = Materializer(RayFetcher(timeout_s=60), repair=loader.repair)
    for current in (step, loader.next_step()):
        requests = requests_for_samples(current, current.sample_ids())
        worker.prefetch(loader.assignment(current, requests))
        out = worker.get(current.step)
        _check_step(current, requests, out)  # every sample's pixels, exactly once, correct
        assert [(r.prompt, r.item_index) for r in requests] == [
            (p.key, i) for p in current.prompts for i in range(len(p.meta.items))]
    # next_step(1) waits for step 1's decodes: the first lost task re-routes all of the victim's
    # prompts (step 0's cached ones too), later failures find them moved
    assert loader.stats.num_rerouted >= len(unfinished)
    assert victim not in pool.alive and not loader.store.owned_by(victim)

    # objects already cached by an actor that then dies are lost too: re-routed on fetch
    pool.set_decode_delay(0.0)
    step2 = loader.next_step()
    tasks = [loader.store.entry(p.key).task_ref for p in step2.prompts]
    ray.wait(tasks, num_returns=len(tasks), timeout=60, fetch_local=False)
    victim = loader.store.entry(step2.prompts[0].key).owner
    probe_ref = next(iter(ray.get(tasks[0]).values()))
    pool.kill(victim)
    wait_until_lost(probe_ref)
    requests = requests_for_samples(step2, step2.sample_ids())
    worker.prefetch(loader.assignment(step2, requests))
    out = worker.get(step2.step)
    _check_step(step2, requests, out)
    assert out.num_repairs > 0 and len(pool.alive) == 1


def ray_wait_done(ref) -> bool:
    return bool(ray.wait([ref], timeout=0, fetch_local=False)[0])





def test_slices_are_read_zero_copy_and_workers_get_owned_tensors_with_timings(shared_pool, records):
    """The store holds numpy pixels (a reader maps them read-only, no unpickling copy); what the
    Materializer hands out is a writable tensor of its own, and it says where its time went."""
    loader = ProxyLoader(records, shared_pool, LoaderConfig(global_batch=2, seed=3, lookahead_steps=0))
    step = loader.next_step()
    entry = loader.store.entry(step.prompts[0].key)
    slice_map = shared_pool.task_result(entry.task_ref)
    stored = ray.get(next(iter(slice_map.values())))
    assert isinstance(stored["pixel_values"], np.ndarray) and not stored["pixel_values"].flags.writeable
    del stored
    requests = requests_for_samples(step, step.sample_ids())
    worker = Materializer(RayFetcher(timeout_s=60))
    worker.prefetch(loader.assignment(step, requests))
    out = worker.get(step.step)
    _check_step(step, requests, out)
    assert all(tensors["pixel_values"].numpy().flags.writeable for tensors in out.tensors)
    timing = out.timing
    assert timing["ready_at"] >= timing["prefetched_at"]
    assert min(timing["task_wait_s"], timing["pull_s"], timing["cut_s"]) >= 0.0
    loader.release(step)
    loader.close()
