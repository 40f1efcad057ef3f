"""`flexrl logprobs --loader local` (1 and 4 gloo processes, FlexUlysses + balanced vision) equals plain HF
log-probs. The shadow loader (Ray actors) is compared with this path in tests/ray/test_logprobs_shadow.py."""

from __future__ import annotations

import json

import pytest
import torch

from flexrl_ds.cli.main import main

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from flexrl_ds.models.sample_data import write_scoring_dataset

    root = tmp_path_factory.mktemp("logprobs")
    assert main(["make-tiny-model", "--out", str(root / "model"), "--seed", "9"]) == 0
    assert main(["make-tiny-model", "--out", str(root / "model-qwen3-vl"), "--seed", "9", "--arch", "qwen3-vl"]) == 0
    data = write_scoring_dataset(root / "data", num_records=8, seed=6)
    return root, data


def _reference(model_dir, data):
    from flexrl_ds.models.flex_model import reference_logprobs
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.tools.logprobs import encode_dataset

    model = load_model(str(model_dir))
    samples = encode_dataset(str(model_dir), str(data))
    with torch.no_grad():
        return {s: (x.input_ids.tolist(), x.response_start, reference_logprobs(model, x)) for s, x in samples.items()}


@pytest.mark.parametrize("nproc,given_plan,model", [(1, False, "model"), (4, True, "model"),
                                                   (4, True, "model-qwen3-vl")])
def test_logprobs_cli_equals_hf(setup, nproc, given_plan, model):
    """nproc 1: planner's plan; nproc 4: a given plan mixing degrees 4, 2 and 1 (the planner picks
    degree 4 for everything on inputs this small). model-qwen3-vl: a tiny Qwen3-VL (timestamped
    multi-group videos, DeepStack)."""
    from flexrl_ds.models.sample_data import random_plan_for

    root, data = setup
    reference = _reference(root / model, data)
    out, plan_out = root / f"out{nproc}{model}.jsonl", root / f"plan{nproc}{model}.json"
    argv = ["logprobs", "--model", str(root / model), "--data", str(data), "--nproc", str(nproc),
            "--out", str(out), "--plan-out", str(plan_out), "--loader", "local"]
    if given_plan:
        plan = random_plan_for({s: len(ids) for s, (ids, _, _) in reference.items()}, nproc, nproc, seed=5)
        assert {p.degree for p in plan.packs} == {1, 2, 4}
        plan.save(root / "given_plan.json")
        argv += ["--plan", str(root / "given_plan.json"), "--p-max", str(nproc)]
    assert main(argv) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == list(reference)
    for line in lines:
        ids, start, expected = reference[line["id"]]
        assert line["input_ids"] == ids and line["response_start"] == start
        assert len(line["logprobs"]) == len(ids) - start
        torch.testing.assert_close(torch.tensor(line["logprobs"]), expected, atol=5e-5, rtol=1e-5)
    plan = json.loads(plan_out.read_text())
    assert plan["world_size"] == nproc
    assert sorted(s for p in plan["packs"] for s in p["sequences"]) == sorted(reference)


def test_logprobs_bad_options_are_user_errors(setup, capsys):
    root, data = setup
    assert main(["logprobs", "--model", str(root / "model"), "--data", str(data), "--nproc", "3",
                 "--out", str(root / "x.jsonl")]) == 2
    assert "--nproc" in capsys.readouterr().err
    assert main(["logprobs", "--model", str(root / "nope"), "--data", str(data), "--out", str(root / "x.jsonl")]) == 2
    with pytest.raises(SystemExit):  # argparse choices
        main(["logprobs", "--model", str(root / "model"), "--data", str(data), "--out", str(root / "x.jsonl"),
              "--loader", "central"])
