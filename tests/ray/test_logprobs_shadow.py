"""`flexrl logprobs --loader shadow` (the data controller's preprocessing actors; rank actors of a
Ray worker group pull their own vision units) equals `--loader local` and plain HF log-probs, and the
parent handles no pixels."""

from __future__ import annotations

import json

import pytest
import ray
import torch
from ray_helpers import wait_until_lost

from flexrl_ds.cli.main import main

pytestmark = [pytest.mark.ray, pytest.mark.integration, pytest.mark.timeout(300)]

BAD_ROWS = [
    {"id": "bad-missing", "prompt": "<image>\nwhat?", "images": ["media/none.png"], "response": "no"},
    {"id": "bad-no-response", "prompt": "hello?", "images": []},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from flexrl_ds.models.flex_model import reference_logprobs
    from flexrl_ds.models.sample_data import random_plan_for, write_scoring_dataset
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.tools.logprobs import encode_dataset

    root = tmp_path_factory.mktemp("logprobs_shadow")
    assert main(["make-tiny-model", "--out", str(root / "model"), "--seed", "9"]) == 0
    data = write_scoring_dataset(root / "data", num_records=8, seed=6)
    with data.open("a") as handle:  # bad rows in the middle of the file: both loaders must skip them
        handle.write("".join(json.dumps(row) + "\n" for row in BAD_ROWS))
    samples = encode_dataset(str(root / "model"), str(data))  # the reference: decoded in this process
    model = load_model(str(root / "model"))
    with torch.no_grad():
        reference = {s: (x.input_ids.tolist(), x.response_start, reference_logprobs(model, x))
                     for s, x in samples.items()}
    plan = random_plan_for({s: x.length for s, x in samples.items()}, 2, 2, seed=3)
    assert {p.degree for p in plan.packs} == {1, 2}
    plan.save(root / "plan.json")
    return root, data, samples, reference


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def local_run(setup):
    """`--loader local` on the same plan: the reference output and its stderr (skipped records)."""
    root, data, _, _ = setup
    argv = ["logprobs", "--model", str(root / "model"), "--data", str(data), "--nproc", "2",
            "--plan", str(root / "plan.json"), "--loader", "local", "--out", str(root / "local.jsonl")]
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(argv) == 0
    return _lines(root / "local.jsonl"), err.getvalue()


def _shadow(root, data, out, num_actors):
    from flexrl_ds.tools.logprobs import LogprobsConfig, run_logprobs

    return run_logprobs(LogprobsConfig(model_dir=str(root / "model"), data_path=str(data), out_path=str(out),
                                       num_procs=2, plan_in=str(root / "plan.json"), loader="shadow",
                                       num_actors=num_actors, timeout_s=240))


def _assert_same(shadow, local, reference):
    assert [line["id"] for line in shadow] == [line["id"] for line in local] == list(reference)
    for ours, theirs in zip(shadow, local):
        ids, start, expected = reference[ours["id"]]
        assert ours["input_ids"] == theirs["input_ids"] == ids and ours["response_start"] == start
        torch.testing.assert_close(torch.tensor(ours["logprobs"]), torch.tensor(theirs["logprobs"]),
                                   atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.tensor(ours["logprobs"]), expected, atol=5e-5, rtol=1e-5)


def test_shadow_equals_local_and_hf_without_pixels_in_parent(ray_session, setup, local_run, capsys):
    from flexrl_ds.tools.logprobs import pixel_bytes_in

    root, data, samples, reference = setup
    local, local_err = local_run
    report = _shadow(root, data, root / "shadow.jsonl", num_actors=1)
    shadow_err = capsys.readouterr().err
    assert report.loader == "shadow"
    _assert_same(_lines(root / "shadow.jsonl"), local, reference)
    for row in BAD_ROWS:  # the same records skipped, with their ids named, by both loaders
        assert f"skipped record {row['id']!r}" in local_err and f"skipped record {row['id']!r}" in shadow_err

    usage = report.usage
    total_pixels = pixel_bytes_in(samples)
    assert total_pixels > 0 and usage.controller_pixel_bytes == 0
    # every vision unit pulled exactly once, by the one rank that encodes it (no media is shared here)
    assert usage.rank_pixel_bytes == total_pixels
    assert usage.controller_bytes < total_pixels / 10
    assert "parent data:" in report.summary and "pixels 0 B" in report.summary


def test_actor_lost_after_decode_is_rerouted(ray_session, setup, local_run, monkeypatch, capsys):
    """An actor dies after the step was decoded, before the ranks fetch: the ranks meet lost
    objects, the loader service re-routes that actor's prompts (decoded again elsewhere) when their
    fetch asks it to; the output is unchanged."""
    from flexrl_ds.loader.materializer import SliceRequest
    from flexrl_ds.tools import shadow_step

    root, data, _, reference = setup
    load_step, killed = shadow_step.load_step, []

    def load_then_kill(controller, *args):
        step = load_step(controller, *args)
        service, prompts = controller.service, step.step.prompts
        owners = ray.get([service.owner_of.remote(prompt.key) for prompt in prompts], timeout=30)
        cost = [sum(g[0] * g[1] * g[2] for g in (item.grid_thw for item in p.meta.items)) for p in prompts]
        victim = owners[max(range(len(prompts)), key=cost.__getitem__)]
        requests = [SliceRequest(p.key, 0) for p in prompts if p.meta.items]
        sources = ray.get(service.assignment.remote(step.step.step, requests), timeout=30).sources
        ray.get(service.kill_preprocess_actor.remote(victim), timeout=30)
        # A dead owner's objects become unreachable asynchronously; wait until they are, so the
        # ranks deterministically meet the loss (not a copy still mapped in the node's store).
        for prompt, owner in zip(prompts, owners):
            if owner == victim and prompt.key in sources:  # text-only prompts have nothing to lose
                slice_refs = list(ray.get(sources[prompt.key].task_ref, timeout=10).values())
                wait_until_lost(slice_refs[0], timeout_s=60)
        killed.append(victim)
        return step

    monkeypatch.setattr(shadow_step, "load_step", load_then_kill)
    report = _shadow(root, data, root / "shadow_fault.jsonl", num_actors=2)
    assert killed and "re-routed" in capsys.readouterr().err and report.usage.num_rerouted > 0
    _assert_same(_lines(root / "shadow_fault.jsonl"), local_run[0], reference)
