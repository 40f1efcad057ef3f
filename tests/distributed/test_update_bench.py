"""`flexrl bench update` (flexrl_ds/bench/update_bench.py) in a process of its own: the ways of
computing the update's forward and backward (per-sample and padded-batch transformers among them)
give the same loss as a plain per-sample reference written here, over the samples the bench says
it built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench_assets(tmp_path_factory):
    from flexrl_ds.models.sample_data import write_scoring_dataset
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("update_bench")
    model = make_tiny_model(TinyModelConfig(out_dir=str(root / "model"), seed=5))
    data = write_scoring_dataset(root / "data", num_records=4, seed=2)
    return root, str(model), str(data)


def _reference_loss(model_dir: str, data: str, response_length: int, copies: int) -> float:
    """The bench's samples rebuilt (its `bench_samples`), scored by a plain HF forward each."""
    from flexrl_ds.bench.update_bench import UpdateBenchConfig, bench_samples
    from flexrl_ds.models.flex_model import reference_logprobs
    from flexrl_ds.models.loading import load_model, ordinary_token_bound

    model = load_model(model_dir)
    config = UpdateBenchConfig(model_dir, data, "", response_length=response_length, samples_per_prompt=copies)
    samples = bench_samples(config, ordinary_token_bound(model.config))
    assert len(samples) == 4 * copies and all(s.length - s.response_start == response_length for s in samples.values())
    vision_tokens = {model.config.image_token_id, model.config.video_token_id, model.config.vision_start_token_id}
    assert not any(set(s.input_ids[s.response_start:].tolist()) & vision_tokens for s in samples.values())
    with torch.no_grad():
        logprobs = torch.cat([reference_logprobs(model, s) for s in samples.values()])
    return float(-logprobs.sum() / logprobs.numel())


def _bench(model_dir: str, data: str, config: Path, out: Path, *extra: str) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(name, None)
    completed = subprocess.run(
        [sys.executable, "-m", "flexrl_ds", "bench", "update", "--model", model_dir, "--data", data,
         "--config", str(config), "--response-length", "40", "--samples-per-prompt", "3", "--repeats", "1",
         "--json", str(out), *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    return {**json.loads(out.read_text()), "stdout": completed.stdout}


def test_every_way_computes_the_reference_loss(bench_assets):
    root, model_dir, data = bench_assets
    result = _bench(model_dir, data, ROOT / "ds_configs" / "grpo_tiny_cpu.json", root / "result.json", "--checkpointing")
    expected = _reference_loss(model_dir, data, 40, 3)
    assert set(result["loss"]) == {"hf", "hf_batched", "flexrl", "zero3", "logprob"}
    assert set(result["seconds"]) == set(result["loss"]) | {"zero3_step", "grpo"}
    for way in ("hf", "hf_batched", "flexrl", "zero3", "logprob"):
        assert result["loss"][way] == pytest.approx(expected, rel=1e-5), way
        assert result["seconds"][way] > 0 and f"bench update: {way}:" in result["stdout"]
    assert result["num_samples"] == 12 and result["seconds"]["zero3_step"] > 0 and result["seconds"]["grpo"] > 0
    assert result["packs"] > 1 and result["attention_calls"] == 1  # the CPU config's small packs, joined
    assert result["micro_batches"] == {"update": 1, "logprob": 1}
    # Under a token cap the passes run as the trainer cuts them: the same loss from several micro-batches.
    config = json.loads((ROOT / "ds_configs" / "grpo_tiny_cpu.json").read_text())
    config["flexrl"]["sp"].update(max_tokens_per_rank=result["tokens"] // 3, logprob_max_tokens_per_rank=result["tokens"])
    (root / "capped.json").write_text(json.dumps(config))
    capped = _bench(model_dir, data, root / "capped.json", root / "capped_result.json", "--ways",
                    "hf_batched,flexrl,zero3,logprob", "--hf-batch-tokens", "300", "--profile", str(root / "profile"))
    assert capped["micro_batches"]["update"] >= 3 and capped["micro_batches"]["logprob"] == 1
    assert capped["attention_calls"] == capped["micro_batches"]["update"]
    for way in ("hf_batched", "flexrl", "zero3", "logprob"):
        assert capped["loss"][way] == pytest.approx(expected, rel=1e-5), way
    # --profile: one more zero3 pass and step under torch.profiler, both regions in the table.
    table = (root / "profile" / "zero3.txt").read_text()
    assert "flexrl/zero3_forward_backward" in table and "flexrl/zero3_optimizer_step" in table
    assert (root / "profile" / "zero3.json.gz").stat().st_size > 0
    assert f"zero3 profiled: {root / 'profile' / 'zero3.txt'}" in capped["stdout"]
    # hf_batched profiled too, its regions named as the trainer's.
    table = (root / "profile" / "hf_batched.txt").read_text()
    assert all(f"flexrl/{name}" in table for name in ("hf_batched_forward_backward", "decoder", "lm_head"))
    # Every way asked has its own table, split by the same regions; the hf ways' vision tower marked too.
    for way in ("hf_batched", "flexrl", "zero3", "logprob"):
        table = (root / "profile" / f"{way}.txt").read_text()
        assert f"flexrl/{way}_forward_backward" in table and "flexrl/vision_tower" in table, way
        assert ("flexrl/backward" in table) == (way != "logprob"), way
    # The vision tower alone over each way's media: hf_batched's per sample, flexrl's once per prompt.
    assert set(capped["vision_seconds"]) == {"hf_batched", "flexrl"}
    assert all(seconds > 0 for seconds in capped["vision_seconds"].values())


def test_a_sample_over_the_cap_is_an_error_even_where_the_run_drops_it(bench_assets):
    """flexrl.sp.oversize "drop" under a cap the longest sample does not fit: the bench refuses,
    naming the cap, instead of timing ways that no longer compute the same loss."""
    from flexrl_ds.bench.update_bench import UpdateBenchConfig, bench_batches, bench_samples, one_rank_sp
    from flexrl_ds.models.loading import load_model, ordinary_token_bound
    from flexrl_ds.planning.config import SPConfig

    _, model_dir, data = bench_assets
    model = load_model(model_dir)
    samples = bench_samples(UpdateBenchConfig(model_dir, data, "", response_length=8, samples_per_prompt=1),
                            ordinary_token_bound(model.config))
    longest = max(sample.length for sample in samples.values())
    with pytest.raises(ValueError, match=f"max_tokens_per_rank={longest - 1}"):
        bench_batches(model, model_dir, samples, one_rank_sp(SPConfig(p_max=4, max_tokens_per_rank=longest - 1,
                                                                      oversize="drop")))
    assert len(bench_batches(model, model_dir, samples, one_rank_sp(SPConfig(p_max=4)))) == 1
