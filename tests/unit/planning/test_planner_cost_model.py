"""Cost model: presets, HF config.json reading, calibration."""

from __future__ import annotations

import json

import pytest

from flexrl_ds.planning.cost_model import PRESETS, load_cost_model


def test_qwen25_vl_7b_c_matches_plan_schema():
    cost = load_cost_model("qwen2.5-vl-7b")
    # docs/PLAN_SCHEMA.md: c ≈ 65,000 for h=3584, 28 heads, 4 KV heads, MLP 18944.
    h, kv_dim, mlp = 3584, 4 * 128, 18944
    per_layer = 2 * h * h + 2 * h * kv_dim + 3 * h * mlp
    assert cost.c == pytest.approx(per_layer / h)
    assert 64_000 < cost.c < 66_000
    assert (cost.num_heads, cost.num_kv_heads) == (28, 4)
    assert cost.cost(1000) == pytest.approx(1000 ** 2 + cost.c * 1000)
    assert cost.vision_cost(10) == 40  # 2x2 merged patches


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_have_positive_c_and_heads(name):
    cost = load_cost_model(name)
    assert cost.c > 10_000 and cost.num_heads % cost.num_kv_heads == 0


def _qwen_vl_config(nested: bool) -> dict:
    text = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2}
    if nested:
        return {"model_type": "qwen2_5_vl", "text_config": text, "vision_config": {"depth": 2}}
    return {"model_type": "qwen2", **text}


def test_config_json_flat_and_nested_agree(tmp_path):
    flat, nested = tmp_path / "flat", tmp_path / "nested"
    for folder, config in ((flat, _qwen_vl_config(False)), (nested, _qwen_vl_config(True))):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    a, b = load_cost_model(str(flat)), load_cost_model(str(nested / "config.json"))
    # head_dim = 64 / 4 = 16: P = 2*64*64 + 2*64*2*16 + 3*64*128
    assert a.c == b.c == pytest.approx((2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) / 64)
    assert (b.num_heads, b.num_kv_heads) == (4, 2)


def test_bad_config_names_the_field(tmp_path):
    config = _qwen_vl_config(True)
    config["text_config"]["hidden_size"] = "wide"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_size"):
        load_cost_model(str(path))
    with pytest.raises(ValueError, match="not a preset"):
        load_cost_model("no-such-model")


def test_calibration_sets_c_and_seconds(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"attention_s_per_token2": 1e-12, "linear_s_per_token": 5e-8,
                                "all_to_all": {"4": {"latency_s": 1e-5, "bytes_per_s": 1e11}},
                                "bytes_per_token": 1000}))
    cost = load_cost_model("qwen2.5-vl-7b", path)
    assert cost.c == pytest.approx(50_000)
    assert cost.seconds(cost.cost(1000)) == pytest.approx((1e6 + 5e7) * 1e-12)
    assert cost.all_to_all_seconds(4000, 4) == pytest.approx(1e-5 + 3000 * 1000 / 1e11)
    assert cost.all_to_all_seconds(4000, 1) == 0.0
    assert load_cost_model("qwen2.5-vl-7b").seconds(1.0) is None
    path.write_text(json.dumps({"attention_s_per_token2": 1e-12}))
    with pytest.raises(ValueError, match="malformed calibration"):
        load_cost_model("qwen2.5-vl-7b", path)
