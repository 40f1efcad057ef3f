"""A decode failure found in a *worker process* after hand-out goes through the loader's policy.

The loader runs in a `LoaderService` actor; the Materializer runs in this test process (so in
another process than the loader, like a training worker) with `RemoteRepair`. After step 0 is handed out, the actor holding an image prompt's slices is killed
and that image is broken on disk: the worker's fetch is lost, its repair re-routes the prompt, the
re-decode fails, and the loader withdraws the prompt (reported with id and reason, counted, once);
every other prompt arrives intact (compared with `SamplePreprocessor.materialize` run here).
"""

from __future__ import annotations

import functools
import time

import pytest
import ray
import torch

from flexrl_ds.bench.loader_media import MediaDatasetSpec, write_media_dataset
from flexrl_ds.data.config import DataConfig, LoaderSection, PoolSection
from flexrl_ds.data.loader_service import LoaderService, RemoteRepair
from flexrl_ds.data.materializer import Materializer, RayFetcher
from flexrl_ds.data.preprocess import SamplePreprocessor
from flexrl_ds.data.proxy_loader import requests_for_samples
from flexrl_ds.data.records import read_dataset
from flexrl_ds.data.types import BadMediaError

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120)]

DATA_CONFIG = DataConfig(
    image_max_pixels=28 * 28 * 16, bad_record_policy="replace",
    loader=LoaderSection(global_batch=4, shuffle=False, lookahead_steps=0),
    pool=PoolSection(num_actors_per_node=2, num_cpus_per_actor=0.5, timeout_s=60.0),
)
_make_preprocessor = functools.partial(SamplePreprocessor, DATA_CONFIG)


def _fetch_in_worker(assignment, repair):
    """What a training worker does: a Materializer fetching one assignment."""
    materializer = Materializer(RayFetcher(timeout_s=60), repair=repair, num_threads=2)
    materializer.prefetch(assignment)
    try:
        out = materializer.get(assignment.step)
    except BadMediaError as error:
        return {"error": str(error)}
    finally:
        materializer.close()
    return {"pixels": [tensors["pixel_values"] for tensors in out.tensors], "num_repairs": out.num_repairs}


def _wait_until_lost(ref, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(ref, timeout=timeout_s)
        except ray.exceptions.ObjectLostError:
            return
        time.sleep(0.2)
    raise AssertionError("the dead actor's objects stayed readable")


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
        _wait_until_lost(next(iter(slice_refs.values())))

        result = _fetch_in_worker(assignment, RemoteRepair(service, timeout_s=60))
        assert "record 'image-0000'" in result["error"] and "cannot decode image" in result["error"]
        report = ray.get(service.report.remote(step.step))
        assert list(report["withdrawn"]) == ["image-0000"] and "cannot decode" in report["withdrawn"]["image-0000"]
        assert [(b["id"], b["stage"]) for b in report["bad_records"]] == [("image-0000", "materialize")]
        assert report["replacements"] == {}  # no substitute after hand-out, even under replace
        stats = ray.get(service.stats.remote())
        assert (stats["num_withdrawn"], stats["num_bad"]) == (1, 1) and stats["num_rerouted"] >= 1

        # the other prompts (the victim's re-routed ones included) arrive intact
        kept = [r for r in requests if r.prompt != broken.key]
        assignment = ray.get(service.assignment.remote(step.step, kept))
        result = _fetch_in_worker(assignment, RemoteRepair(service, timeout_s=60))
        metas = {p.key: p.meta for p in step.prompts}
        for request, pixels in zip(kept, result["pixels"]):
            reference = SamplePreprocessor(DATA_CONFIG).materialize(metas[request.prompt])[request.item_index]
            assert torch.equal(torch.as_tensor(pixels), reference.pixel_values), request
        assert ray.get(service.stats.remote())["num_withdrawn"] == 1
    finally:
        ray.get(service.shutdown.remote(), timeout=60)
        ray.kill(service)
