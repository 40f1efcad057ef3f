"""ZeRO-3 weights gathered in buckets and exported as an HF directory, on 4 gloo ranks.

Before gathering, every parameter is moved by a known offset (written into the partitions through
`GatheredParameters(modifier_rank=0)`), so the gathered and exported weights must be the partitioned
state, not the files the model came from. Checked: HF names without a wrapper prefix, fewer gathers
than parameters (buckets), every rank receiving the same full tensors, and `from_pretrained` of the
export (in this process, which never registered the FlexUlysses attention) giving exactly those
weights, with the tokenizer and processor files alongside.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

BUCKET_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    return str(make_tiny_model(TinyModelConfig(out_dir=str(tmp_path_factory.mktemp("weights") / "vl"), seed=9)))


def offset(index: int) -> float:
    return 0.001 * (index + 1)


def rank_gather_and_export(model_dir: str, out_dir: str, persistence: int = 0):
    import deepspeed
    from zero3_configs import zero3_config

    from flexrl_ds.models.loading import load_model
    from flexrl_ds.models.weights import iter_weight_buckets, save_hf_export
    from flexrl_ds.models.zero3 import build_engine

    config = zero3_config()
    config["zero_optimization"]["stage3_param_persistence_threshold"] = persistence
    engine = build_engine(load_model(model_dir), config, train=False)
    params = list(engine.module.hf_model.parameters())
    persistent = [bool(getattr(p, "ds_persist", False)) for p in params]
    # threshold 0: every parameter partitioned; higher: the small ones stay whole once gathered
    assert all(p.numel() == 0 for p in params)  # really partitioned, until a first use
    assert not any(persistent) if persistence == 0 else 0 < sum(persistent) < len(params)
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        with torch.no_grad():
            for index, param in enumerate(params):
                param.add_(offset(index))
    buckets = [[(name, tensor.clone()) for name, tensor in bucket]
               for bucket in iter_weight_buckets(engine, BUCKET_BYTES)]
    save_hf_export(engine, out_dir, model_dir)
    engine.destroy()
    return {"buckets": buckets}


@pytest.mark.parametrize("persistence", [0, 2000])
def test_bucketed_gather_and_hf_export_round_trip(model_dir, dist_pools, tmp_path, persistence):
    import transformers

    from flexrl_ds.models.loading import load_model

    original = load_model(model_dir)
    expected = {name: param.detach() + offset(index) for index, (name, param) in enumerate(original.named_parameters())}
    out_dir = tmp_path / "export"
    per_rank = dist_pools(4).run(rank_gather_and_export, model_dir, str(out_dir), persistence, timeout_s=240)
    largest = max(t.numel() * t.element_size() for t in expected.values())
    for result in per_rank:
        buckets = result["buckets"]
        assert 1 < len(buckets) < len(expected)
        for bucket in buckets:
            assert sum(t.numel() * t.element_size() for _, t in bucket) < BUCKET_BYTES + largest
        got = dict(pair for bucket in buckets for pair in bucket)
        assert [name for bucket in buckets for name, _ in bucket] == list(expected)
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, atol=0, rtol=0, msg=name)
    exported = load_model(str(out_dir))
    assert type(exported) is type(original)
    for name, param in exported.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name], atol=0, rtol=0, msg=name)
    assert set(dict(exported.named_parameters())) == set(expected)
    for name in ("tokenizer_config.json", "preprocessor_config.json", "chat_template.jinja"):
        assert (out_dir / name).is_file(), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out_dir))
    assert tokenizer("the answer").input_ids == transformers.AutoTokenizer.from_pretrained(model_dir)("the answer").input_ids
