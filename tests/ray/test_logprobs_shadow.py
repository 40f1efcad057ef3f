"""`flexrl logprobs --loader shadow` (Ray preprocessing actors; spawned ranks join the session's
cluster and pull their own vision units) equals `--loader local` and plain HF log-probs, and the
parent handles no pixels."""

from __future__ import annotations

import json

import pytest
import torch

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
    from flexrl_ds.rl.logprobs import encode_dataset, load_model

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


def test_shadow_equals_local_and_hf_without_pixels_in_parent(ray_session, setup, capsys):
    from flexrl_ds.rl.logprobs import LogprobsConfig, pixel_bytes_in, run_logprobs

    root, data, samples, reference = setup
    common = ["--model", str(root / "model"), "--data", str(data), "--nproc", "2", "--plan", str(root / "plan.json")]
    assert main(["logprobs", *common, "--loader", "local", "--out", str(root / "local.jsonl")]) == 0
    local_err = capsys.readouterr().err
    report = run_logprobs(LogprobsConfig(model_dir=str(root / "model"), data_path=str(data),
                                         out_path=str(root / "shadow.jsonl"), num_procs=2,
                                         plan_in=str(root / "plan.json"), loader="shadow", num_actors=1,
                                         timeout_s=240))
    shadow_err = capsys.readouterr().err
    assert report.loader == "shadow"

    local, shadow = _lines(root / "local.jsonl"), _lines(root / "shadow.jsonl")
    assert [line["id"] for line in shadow] == [line["id"] for line in local] == list(reference)
    for ours, theirs in zip(shadow, local):
        ids, start, expected = reference[ours["id"]]
        assert ours["input_ids"] == theirs["input_ids"] == ids and ours["response_start"] == start
        torch.testing.assert_close(torch.tensor(ours["logprobs"]), torch.tensor(theirs["logprobs"]),
                                   atol=1e-6, rtol=0)
        torch.testing.assert_close(torch.tensor(ours["logprobs"]), expected, atol=5e-5, rtol=1e-5)
    for row in BAD_ROWS:  # the same records skipped, with their ids named, by both loaders
        assert f"skipped record {row['id']!r}" in local_err and f"skipped record {row['id']!r}" in shadow_err

    usage = report.usage
    total_pixels = pixel_bytes_in(samples)
    assert total_pixels > 0 and usage.controller_pixel_bytes == 0
    # every vision unit pulled exactly once, by the one rank that encodes it (no media is shared here)
    assert usage.rank_pixel_bytes == total_pixels
    assert usage.controller_bytes < total_pixels / 10
    assert "parent data:" in report.summary and "pixels 0 B" in report.summary
