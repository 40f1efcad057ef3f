"""Sample encoding: pad expansion, response placement, bad records reported and skipped."""

from __future__ import annotations

import json

import pytest
import torch

from flexrl_ds.models.processing import SampleEncoder, encode_records


def test_pads_expand_to_merged_tokens_and_response_follows(tiny_assets, vl_samples):
    from flexrl_ds.media.records import read_dataset

    model, samples = vl_samples
    config = model.config
    vision_ids = torch.tensor([config.image_token_id, config.video_token_id])
    assert any(s.of_kind("video") for s in samples.values()) and any(s.of_kind("image") for s in samples.values())
    for sample in samples.values():
        ids = sample.input_ids
        assert int((ids == config.image_token_id).sum()) == sum(i.num_tokens() for i in sample.of_kind("image"))
        assert int((ids == config.video_token_id).sum()) == sum(i.num_tokens() for i in sample.of_kind("video"))
        assert not bool(torch.isin(ids[sample.response_start:], vision_ids).any())
        for item in sample.items:
            assert item.pixel_values.shape[0] == item.num_patches
    records = {r.id: r for r in read_dataset(tiny_assets["data"])}
    tokenizer = SampleEncoder(tiny_assets["vl"]).tokenizer
    for seq_id, sample in samples.items():
        assert tokenizer.decode(sample.input_ids[sample.response_start:].tolist()) == records[seq_id].response
        prompt = tokenizer.decode(sample.input_ids[:sample.response_start].tolist())
        assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")


def test_bad_records_are_skipped_and_named(tiny_assets, tmp_path, capsys):
    good = {"id": "ok", "prompt": "what is two", "response": "two"}
    rows = [good, {"id": "no-response", "prompt": "hi"},
            {"id": "missing-media", "prompt": "<image>x", "images": ["nope.png"], "response": "a"}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = encode_records(tiny_assets["vl"], path)
    assert list(samples) == ["ok"]
    err = capsys.readouterr().err
    assert "no-response" in err and "missing-media" in err
    with pytest.raises(ValueError, match="no usable records: none has text under 'response'; --response-key"):
        path.write_text(json.dumps(rows[1]) + "\n")
        encode_records(tiny_assets["vl"], path)
    with pytest.raises(ValueError, match=r"no usable records$"):  # skipped for other reasons: no such hint
        path.write_text(json.dumps(rows[1]) + "\n" + json.dumps(rows[2]) + "\n")
        encode_records(tiny_assets["vl"], path)
    assert encode_records(tiny_assets["vl"], path, response_key="prompt").keys() == {"no-response"}


def test_text_model_rejects_media_records(tiny_assets, capsys):
    samples = encode_records(tiny_assets["q2"], tiny_assets["data"])
    assert samples and all(not s.items for s in samples.values())
    assert "no vision tower" in capsys.readouterr().err
