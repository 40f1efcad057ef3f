"""`flexrl bench update`'s `hf_batched` way (bench/hf_baseline.py): padded, length-sorted micro-batches,
lm_head in checkpointed chunks, transformers' activation checkpointing. Its loss and every parameter's
gradient equal the plain per-sample reference's (one HF forward per sample, full logits), with images,
videos and text-only samples of different lengths in one batch (right padding), for Qwen2.5-VL (its
mRoPE positions given) and Qwen3-VL and its MoE (transformers' own rope index from
`mm_token_type_ids`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flexrl_ds.bench.hf_baseline import hf_batched_pass, padded_micro_batches
from flexrl_ds.bench.update_bench import UpdateBenchConfig, bench_samples, hf_pass
from flexrl_ds.models import zero3
from flexrl_ds.models.loading import load_model, ordinary_token_bound


@pytest.fixture(scope="module", params=["qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe"])
def tiny(tmp_path_factory, request):
    from flexrl_ds.models.sample_data import write_scoring_dataset
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("hf_baseline")
    model_dir = str(make_tiny_model(TinyModelConfig(out_dir=str(root / "model"), arch=request.param, seed=3)))
    data = str(write_scoring_dataset(root / "data", num_records=4, seed=1))
    return model_dir, data


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("budget,chunk,checkpointing", [(10**6, 4096, False), (300, 7, True)])
def test_loss_and_gradients_equal_the_per_sample_reference(tiny, budget, chunk, checkpointing):
    model_dir, data = tiny
    torch.manual_seed(0)
    model = load_model(model_dir)
    config = UpdateBenchConfig(model_dir, data, "", response_length=9, samples_per_prompt=2)
    samples = bench_samples(config, ordinary_token_bound(model.config))
    # Responses of different lengths: rows of one micro-batch differ in length (padding matters).
    samples = {name: dataclasses.replace(s, input_ids=s.input_ids[:s.length - k % 5])
               for k, (name, s) in enumerate(samples.items())}
    assert len({s.length for s in samples.values()}) > 2
    model.train()
    reference_loss = hf_pass(model, samples, temperature=0.7)()
    reference = _grads(model)
    if checkpointing:
        zero3.enable_activation_checkpointing(model)
    batched = hf_batched_pass(model, samples, 0.7, budget, chunk)
    loss = batched()
    assert loss == pytest.approx(reference_loss, rel=1e-5)
    got = _grads(model)
    assert got.keys() == reference.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    lengths = {name: s.length for name, s in samples.items()}
    cuts = padded_micro_batches(lengths, budget)
    assert (len(cuts) == 1) == (budget >= len(samples) * max(lengths.values()))


def test_micro_batches_sorted_and_under_the_budget():
    lengths = {f"s{i}": n for i, n in enumerate([50, 300, 120, 90, 300, 10, 700])}
    batches = padded_micro_batches(lengths, 600)
    assert sorted(name for batch in batches for name in batch) == sorted(lengths)
    flat = [lengths[name] for batch in batches for name in batch]
    assert flat == sorted(flat, reverse=True)  # longest first, across and inside batches
    for batch in batches:
        padded = len(batch) * max(lengths[name] for name in batch)
        assert padded <= 600 or len(batch) == 1
    assert [len(batch) for batch in batches] == [1, 2, 4]  # 700 alone; 300,300; 120,90,50,10
    with pytest.raises(ValueError, match="hf_batch_tokens"):
        padded_micro_batches(lengths, 0)
