"""A decode failure found in a *worker process* after hand-out goes through the loader's policy.

The loader runs in a `LoaderService` actor; the Materializer runs in this test process (so in
another process than the loader, like a training worker) with `RemoteRepair`. After step 0 is handed out, the actor holding an image prompt's slices is killed
and that image is broken on disk: the worker's fetch is lost, its repair re-routes the prompt, the
re-decode fails, and the loader withdraws the prompt (reported with id and reason, counted, once);
the worker's `Materializer.get` returns every other prompt intact in the same step (compared with
`SamplePreprocessor.materialize` run here) and marks the withdrawn one.
"""

from __future__ import annotations

import functools

import pytest
import ray
import torch
from ray_helpers import wait_until_lost

from flexrl_ds.media.bad_records import FATE_WITHDRAWN
from flexrl_ds.bench.loader_media import MediaDatasetSpec, write_media_dataset
from flexrl_ds.loader.config import DataConfig, LoaderConfig, PoolConfig
from flexrl_ds.loader.loader_service import LoaderService, RemoteRepair
from flexrl_ds.loader.materializer import Materializer, RayFetcher
from flexrl_ds.loader.proxy_loader import requests_for_samples
from flexrl_ds.media.preprocess import SamplePreprocessor
from flexrl_ds.media.records import read_dataset

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]

DATA_CONFIG = DataConfig(
    image_max_pixels=28 * 28 * 16, bad_record_policy="replace",
    loader=LoaderConfig(global_batch=4, shuffle=False, lookahead_steps=0),
    pool=PoolConfig(num_actors_per_node=2, num_cpus_per_actor=0.5, timeout_s=60.0),
)
_make_preprocessor = functools.partial(SamplePreprocessor, DATA_CONFIG)


def _fetch_in_worker(assignment, repair):
    """What a training worker does: a Materializer fetching one assignment."""
    materializer = Materializer(RayFetcher(timeout_s=60), repair=repair, num_threads=2,
                                bad_record_policy=DATA_CONFIG.bad_record_policy)
    materializer.prefetch(assignment)
    try:
        return materializer.get(assignment.step)
    finally:
        materializer.close()


def _assert_intact(step, delivered):
    metas = {p.key: p.meta for p in step.prompts}
    for request, tensors in delivered:
        reference = SamplePreprocessor(DATA_CONFIG).materialize(metas[request.prompt])[request.item_index]
        assert torch.equal(torch.as_tensor(tensors["pixel_values"]), reference.pixel_values), request




def test_worker_found_decode_failure_after_hand_out_is_withdrawn_by_the_loader(ray_session, tmp_path):
    path = write_media_dataset(tmp_path, MediaDatasetSpec(num_videos=0, num_images=4))
    records = read_dataset(path)
    service = LoaderService.options(max_concurrency=8).remote(records, _make_preprocessor, DATA_CONFIG)
    try:
        ray.get(service.wait_ready.remote(), timeout=60)
        step = ray.get(service.next_step.remote(), timeout=60)
        assert [p.meta.id for p in step.prompts] == [f"image-{i:04d}" for i in range(4)]
        broken = step.prompts[0]
        requests = requests_for_samples(step, step.sample_ids())
        assignment = ray.get(service.assignment.remote(step.step, requests))
        slice_refs = ray.get(assignment.sources[broken.key].task_ref)
        victim = ray.get(service.owner_of.remote(broken.key))
        with open(broken.meta.items[0].item.path, "wb") as handle:
            handle.write(b"no longer an image")
        ray.get(service.kill_preprocess_actor.remote(victim))
        wait_until_lost(next(iter(slice_refs.values())))

        out = _fetch_in_worker(assignment, RemoteRepair(service, timeout_s=60))
        # the step comes back: the broken prompt marked withdrawn, every other request once, intact
        assert list(out.withdrawn) == [broken.key] and out.num_repairs >= 1
        assert list(out.withdrawn_reasons()) == ["image-0000"]
        assert "cannot decode image" in out.withdrawn_reasons()["image-0000"]
        assert [t is None for t in out.tensors] == [r.prompt == broken.key for r in requests]
        assert [r for r, _ in out.delivered()] == [r for r in requests if r.prompt != broken.key]
        _assert_intact(step, out.delivered())
        report = ray.get(service.report.remote(step.step))
        assert report["withdrawn"] == out.withdrawn_reasons()
        assert [(b["id"], b["stage"]) for b in report["bad_records"]] == [("image-0000", "materialize")]
        assert report["bad_records"][0]["fate"] == FATE_WITHDRAWN
        assert report["replacements"] == {}  # no substitute after hand-out, even under replace
        stats = ray.get(service.stats.remote())
        assert (stats["num_withdrawn"], stats["num_bad"]) == (1, 1) and stats["num_rerouted"] >= 1

        # a second worker asking for the whole step later sees the same, the loader counts it once
        assignment = ray.get(service.assignment.remote(step.step, requests))
        again = _fetch_in_worker(assignment, RemoteRepair(service, timeout_s=60))
        assert again.withdrawn_reasons() == out.withdrawn_reasons()
        _assert_intact(step, again.delivered())
        assert ray.get(service.stats.remote())["num_withdrawn"] == 1
    finally:
        ray.get(service.shutdown.remote(), timeout=60)
        ray.kill(service)


@ray.remote(num_cpus=0.01)
class _ErrorPolicyService:
    """Stands in for a LoaderService whose policy is `error`: repair raises the policy's ValueError."""

    def repair(self, key, failed_generation):
        raise ValueError(f"step {key.step}: record 'image-0000': cannot decode image "
                         "(flexrl.data.bad_record_policy is 'error')")


def test_remote_repair_raises_the_loaders_value_error_as_itself(ray_session):
    from flexrl_ds.loader.metastore import PromptKey

    service = _ErrorPolicyService.remote()
    try:
        with pytest.raises(ValueError, match="record 'image-0000': cannot decode image") as raised:
            RemoteRepair(service, timeout_s=30)(PromptKey(0, 0), 1)
        assert type(raised.value) is ValueError  # not Ray's task error wrapping it
    finally:
        ray.kill(service)
