import json

import pytest

from flexrl_ds.config.flexrl_config import load_run_config, parse_run_config
from flexrl_ds.planning.config import SPConfig


def test_ds_configs_in_repo_load(tmp_path):
    from pathlib import Path

    configs = sorted((Path(__file__).resolve().parents[2] / "ds_configs").glob("*.json"))
    assert configs
    for path in configs:
        run = load_run_config(path)
        assert "flexrl" not in run.deepspeed
        assert run.deepspeed["zero_optimization"]["stage"] == 3
        assert run.flexrl.data.pool.timeout_s > 0  # the flexrl.data section is present and typed


def test_ds_configs_drive_the_loader():
    from pathlib import Path

    from flexrl_ds.loader.config import DataConfig

    folder = Path(__file__).resolve().parents[2] / "ds_configs"
    for name in ("zero3_flexrl.json", "cpu_test.json"):
        raw = json.loads((folder / name).read_text())
        assert {"bad_record_policy", "loader", "pool"} <= set(raw["flexrl"]["data"]), name
        data = load_run_config(folder / name).flexrl.data
        assert data.bad_record_policy == raw["flexrl"]["data"]["bad_record_policy"]
        assert data.loader.global_batch == raw["flexrl"]["data"]["loader"]["global_batch"]
        assert data.pool.num_actors_per_node == raw["flexrl"]["data"]["pool"]["num_actors_per_node"]
        # the files spell out today's defaults
        assert (data.loader, data.pool) == (DataConfig().loader, DataConfig().pool), name


def test_flexrl_section_is_typed():
    run = parse_run_config({"train_batch_size": 8, "flexrl": {"sp": {"p_max": 4, "h_pack": 100, "H_pack": 1000}}})
    assert run.flexrl.sp == SPConfig(p_max=4, h_pack=100, H_pack=1000)
    assert run.deepspeed == {"train_batch_size": 8}


@pytest.mark.parametrize(
    "section, message",
    [
        ({"sp": {"p_maxx": 4}}, "flexrl.sp: unknown key(s) 'p_maxx'"),
        ({"sp": {"p_max": 6}}, "flexrl.sp.p_max: 6 is not a power of two"),
        ({"sp": {"p_max": "8"}}, "flexrl.sp.p_max: expected an integer"),
        ({"sp": {"h_pack": 5000, "H_pack": 100}}, "flexrl.sp.h_pack (5000) exceeds"),
        ({"sp": {"max_tokens_per_rank": 0}}, "flexrl.sp.max_tokens_per_rank: must be positive"),
        ({"sp": {"overlap": 1}}, "flexrl.sp.overlap: expected bool"),
        ({"spp": {}}, "flexrl: unknown key(s) 'spp'"),
    ],
)
def test_bad_values_name_the_key(section, message):
    with pytest.raises(ValueError) as error:
        parse_run_config({"flexrl": section}, source="cfg.json")
    assert message in str(error.value)
    assert "cfg.json" in str(error.value)


def test_bad_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_run_config(path)
    with pytest.raises(ValueError, match="not found"):
        load_run_config(tmp_path / "missing.json")
    path.write_text(json.dumps([1]))
    with pytest.raises(ValueError, match="JSON object"):
        load_run_config(path)


def test_data_section_is_typed():
    from flexrl_ds.loader.config import DataConfig

    run = parse_run_config({"flexrl": {"data": {"video_fps": 1.0, "bad_record_policy": "replace"}}})
    assert isinstance(run.flexrl.data, DataConfig)
    assert run.flexrl.data.video_fps == 1.0
    with pytest.raises(ValueError, match="flexrl.data: unknown key"):
        parse_run_config({"flexrl": {"data": {"video_fpss": 1.0}}})


def test_the_log_prob_passes_cap_only_loosens_the_token_cap():
    from flexrl_ds.planning.config import SPConfig

    loose = SPConfig(max_tokens_per_rank=1000, logprob_max_tokens_per_rank=4000)
    assert loose.for_logprob_passes().max_tokens_per_rank == 4000 and loose.max_tokens_per_rank == 1000
    assert SPConfig(max_tokens_per_rank=1000).for_logprob_passes() == SPConfig(max_tokens_per_rank=1000)
    with pytest.raises(ValueError, match=r"logprob_max_tokens_per_rank \(999\) must be at least .*max_tokens_per_rank \(1000\)"):
        SPConfig(max_tokens_per_rank=1000, logprob_max_tokens_per_rank=999)
    with pytest.raises(ValueError, match=r"logprob_max_tokens_per_rank \(10\) needs flexrl.sp.max_tokens_per_rank"):
        SPConfig(logprob_max_tokens_per_rank=10)


@pytest.mark.parametrize("name, shape", [("grpo_vl3b_1xh200.json", "3b"), ("grpo_vl7b_1xh200.json", "7b")])
def test_the_one_gpu_files_keep_a_checkpointed_layer_gathered_and_walk_no_further(tmp_path, name, shape):
    """`stage3_max_reuse_distance`: two decoder layers of the shape, at least (the recomputed forward
    of a layer and its backward, so the recompute's gathers are reused) and under three and DeepSpeed's 1e9,
    which each engine's first pass on a trace walks ahead at every module (bench/zero3_trace_bench.py).
    The layer is transformers' own, built on the meta device."""
    from pathlib import Path

    import torch
    import transformers
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLDecoderLayer

    from flexrl_ds.bench.rollout_bench import SHAPES
    from flexrl_ds.bench.zero3_trace_bench import DEEPSPEED_DEFAULT_REUSE
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    model_dir = make_tiny_model(TinyModelConfig(out_dir=str(tmp_path / shape), **SHAPES[shape]), weights=False)
    text_config = transformers.AutoConfig.from_pretrained(str(model_dir)).text_config
    with torch.device("meta"):
        layer_elements = sum(p.numel() for p in Qwen2_5_VLDecoderLayer(text_config, 0).parameters())
    zero = json.loads((Path(__file__).resolve().parents[2] / "ds_configs" / name).read_text())["zero_optimization"]
    assert 2 * layer_elements <= zero["stage3_max_reuse_distance"] < min(3 * layer_elements, DEEPSPEED_DEFAULT_REUSE)
