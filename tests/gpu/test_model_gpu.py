"""Issue 3 on 2 GPUs (NCCL): a tiny Qwen2.5-VL under DeepSpeed ZeRO-3 + FlexUlysses, and `flexrl logprobs`.

(a) loss and every parameter's full gradient of one ZeRO-3 + FlexUlysses step on 2 GPU ranks equal a
    single-process HF run on the CPU (fp32) — the same rank function and reference as
    tests/distributed/test_model_zero3.py, on GPU ranks.
(b) `flexrl logprobs --nproc 2` (NCCL workers) equals plain single-process HF log-probs (CPU, fp32).

Media: FLEXRL_GPU_ASSETS may name a folder holding `zero3/samples.jsonl` and `logprobs/samples.jsonl`
written elsewhere (the GPU machine has no video encoder; tests/gpu/run_model_on_gpu_machine.sh
explains); otherwise they are written here (videos only where torchcodec's encoder works).
Skipped without 2 GPUs.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))

import test_model_zero3 as zero3_case  # noqa: E402  (its rank function and reference, reused)
from harness import gpu_pool  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.dist, pytest.mark.timeout(400)]


def _strict_fp32() -> None:
    """fp32 means fp32 on the GPU (cuDNN convolutions default to TF32: the vision patch embedding)."""
    from flexrl_ds.parallel.device import use_full_precision_kernels

    use_full_precision_kernels()


def _dataset(name: str, tmp_root: Path, **kwargs) -> Path:
    from flexrl_ds.models.sample_data import write_scoring_dataset

    given = os.environ.get("FLEXRL_GPU_ASSETS")
    if given:
        return Path(given, name, "samples.jsonl")
    try:
        from torchcodec.encoders import VideoEncoder  # noqa: F401
        with_video = True
    except Exception:
        with_video = False
    return write_scoring_dataset(tmp_root / name, with_video=with_video, **kwargs)


@pytest.fixture(scope="module")
def two_gpu_pool():
    with gpu_pool(2) as pool:
        yield pool


def rank_zero3_step_gpu(*args, **kwargs):
    """tests/distributed's ZeRO-3 rank step, on this rank's GPU with strict fp32."""
    _strict_fp32()
    return zero3_case.rank_zero3_step(*args, **kwargs)


@pytest.mark.parametrize("seed", [0, 1, -1])
def test_zero3_flex_ulysses_two_gpus_matches_single_process(two_gpu_pool, tmp_path_factory, seed):
    """seed >= 0: a random plan mixing degrees 2 and 1; seed -1: every token on rank 0 (idle rank 1)."""
    from flexrl_ds.models.sample_data import random_plan_for
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("zero3gpu")
    model_dir = str(root / "vl")
    make_tiny_model(TinyModelConfig(out_dir=model_dir, seed=5))
    data = str(_dataset("zero3", root, num_records=7, seed=2))
    ref_nll, ref_tokens, ref_grads, lengths = zero3_case._reference(model_dir, data)
    plan = random_plan_for(lengths, 2, p_max=2, seed=seed) if seed >= 0 else zero3_case._all_on_rank_zero(lengths, 2)
    per_rank = two_gpu_pool.run(rank_zero3_step_gpu, model_dir, data, plan.to_json(), plan.p_max, timeout_s=300)
    assert all(r["num_global"] == ref_tokens for r in per_rank)
    nll = sum(r["nll"] for r in per_rank)
    paths = {p for r in per_rank for p in r["paths"]}
    grads = per_rank[0]["grads"]
    assert set(grads) == set(ref_grads)
    worst = max(((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp(min=1e-6)).item()
                for n in ref_grads)
    print(f"zero3 seed={seed} degrees={sorted({p.degree for p in plan.packs})} paths={sorted(paths)} "
          f"patches={per_rank[0]['patches']}: loss rel err {abs(nll - ref_nll) / abs(ref_nll):.3g}, "
          f"worst grad err (rel. to max|grad|) {worst:.3g} over {len(ref_grads)} tensors")
    assert nll == pytest.approx(ref_nll, rel=1e-5)
    assert seed < 0 or paths & {"flex", "flex-async", "deepspeed"}, paths
    assert sum(p > 0 for p in per_rank[0]["patches"]) == 2, per_rank[0]["patches"]
    assert worst < 1e-4, worst


def test_logprobs_cli_two_gpus_equals_hf(tmp_path):
    from flexrl_ds.cli.main import main
    from flexrl_ds.models.flex_model import reference_logprobs
    from flexrl_ds.models.sample_data import random_plan_for
    from flexrl_ds.parallel import device
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.tools.logprobs import encode_dataset

    if device.num_gpus() < 2:
        pytest.skip("needs 2 GPUs")
    assert main(["make-tiny-model", "--out", str(tmp_path / "model"), "--seed", "9"]) == 0
    data = _dataset("logprobs", tmp_path, num_records=8, seed=6)
    model = load_model(str(tmp_path / "model"))
    samples = encode_dataset(str(tmp_path / "model"), str(data))
    with torch.no_grad():
        reference = {s: (x.input_ids.tolist(), x.response_start, reference_logprobs(model, x))
                     for s, x in samples.items()}
    plan = random_plan_for({s: len(ids) for s, (ids, _, _) in reference.items()}, 2, 2, seed=5)
    plan.save(tmp_path / "given_plan.json")
    for name, extra in (("planner", []), ("given", ["--plan", str(tmp_path / "given_plan.json")])):
        out = tmp_path / f"out_{name}.jsonl"
        argv = ["logprobs", "--model", str(tmp_path / "model"), "--data", str(data), "--nproc", "2",
                "--out", str(out), "--plan-out", str(tmp_path / f"plan_{name}.json"), *extra]
        assert main(argv) == 0
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert [line["id"] for line in lines] == list(reference)
        worst = 0.0
        for line in lines:
            ids, start, expected = reference[line["id"]]
            assert line["input_ids"] == ids and line["response_start"] == start
            worst = max(worst, (torch.tensor(line["logprobs"]) - expected).abs().max().item())
        degrees = sorted({p["degree"] for p in json.loads((tmp_path / f"plan_{name}.json").read_text())["packs"]})
        print(f"logprobs --nproc 2 ({name} plan, degrees {degrees}): {sum(len(line['logprobs']) for line in lines)} "
              f"tokens, max |logprob - HF| {worst:.3g}")
        for line in lines:
            torch.testing.assert_close(torch.tensor(line["logprobs"]), reference[line["id"]][2], atol=5e-5, rtol=1e-5)
