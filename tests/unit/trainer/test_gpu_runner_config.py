"""The GPU trainer runner (tests/gpu/run_trainer_on_gpu_machine.sh) builds its run config from the
shipped one-H200 files in ds_configs/ and its environment. Its config step runs here on CPU: every
combination must give a run config that loads, and each switch must land where the runner says."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flexrl_ds.config.flexrl_config import load_run_config

ROOT = Path(__file__).resolve().parents[3]
RUNNER = ROOT / "tests" / "gpu" / "run_trainer_on_gpu_machine.sh"
RUNNER_SWITCHES = ("OFFLOAD_RATIO", "OFFLOAD_PIN", "OFFLOAD_IN_ROLLOUT", "REF_OFFLOAD", "SAVE", "CKPT", "HF_KV_CACHE", "HF_SLEEP_LEVEL",
                   "TEMPERATURE", "TOP_P", "TOP_K", "PROMPTS", "RESPONSE_LENGTH", "MAX_TOKENS_PER_RANK", "LOGPROB_MAX_TOKENS_PER_RANK", "PROFILE_STEP",
                   "VISION_ATTENTION", "PACK_BELOW", "PACK_BUDGET", "ZERO3_PERSISTENCE",
                   "ZERO3_PREFETCH", "ZERO3_REUSE", "ZERO3_TRACE_WARNINGS", "ZERO3_LEAF_LAYERS", "ZERO3_GRANULARITY",
                   "ZERO3_MEMORY_EFFICIENT_LINEAR", "CARD", "LOADING", "RUN_CONFIG")
"""Environment variables the runner's config step reads (cleared, then set by each test)."""


def runner_config_step() -> str:
    """The Python that the runner feeds to `python3 - "$work/config.json" ...` (its first heredoc
    after that line)."""
    text = RUNNER.read_text()
    match = re.search(r'python3 - "\$work/config\.json".*?<<\'PY\'\n(.*?)\nPY\n', text, re.S)
    assert match, "the runner's config step was not found"
    return match.group(1)


def build(tmp_path, backend: str, shape: str, colocate: str = "1", gpus: int = 1, **env: str) -> dict:
    path = tmp_path / f"{shape}_{backend}_{colocate}_{gpus}.json"
    clean = {k: v for k, v in os.environ.items()
             if k not in RUNNER_SWITCHES}
    size = "8b" if shape.startswith("qwen3-vl") else shape  # the runner's choice of file, as its shell does it
    env.setdefault("RUN_CONFIG", f"ds_configs/grpo_vl{size}_1x{env.get('CARD', 'h200')}.json")
    subprocess.run([sys.executable, "-c", runner_config_step(), str(path), backend, shape, colocate, str(gpus)],
                   cwd=ROOT, env={**clean, **env}, check=True)
    return json.loads(path.read_text())


@pytest.mark.parametrize("shape", ["3b", "7b", "qwen3-vl-8b"])
@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_every_backend_and_shape_gives_a_valid_run_config(tmp_path, shape, backend):
    size = "8b" if shape.startswith("qwen3-vl") else shape
    shipped = json.loads((ROOT / "ds_configs" / f"grpo_vl{size}_1xh200.json").read_text())
    raw = build(tmp_path, backend, shape)
    run = load_run_config(tmp_path / f"{shape}_{backend}_1_1.json")
    assert run.flexrl.rollout.backend == backend
    assert run.flexrl.trainer.save_every == 0 and not run.flexrl.trainer.save_last
    assert run.flexrl.trainer.colocate
    # apart from the rollout section and the save settings, the shipped file as it is
    for key in ("optimizer", "zero_optimization", "bf16"):
        assert raw[key] == shipped[key], key
    assert raw["flexrl"]["data"] == shipped["flexrl"]["data"]
    if backend == "hf":
        assert "vllm" not in raw["flexrl"]["rollout"]
        assert (run.flexrl.rollout.hf.kv_cache, run.flexrl.rollout.hf.sleep_level) == ("dynamic", 2)
    else:
        assert raw["flexrl"]["rollout"]["vllm"] == shipped["flexrl"]["rollout"]["vllm"]


def test_the_switches_land_in_the_config(tmp_path):
    raw = build(tmp_path, "hf", "7b", OFFLOAD_RATIO="0.5", SAVE="1", CKPT="1",
                HF_KV_CACHE="static", HF_SLEEP_LEVEL="1", OFFLOAD_IN_ROLLOUT="0", OFFLOAD_PIN="0", REF_OFFLOAD="1")
    assert raw["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False, "ratio": 0.5}
    trainer = raw["flexrl"]["trainer"]
    assert trainer["save_last"] and trainer["activation_checkpointing"]
    assert trainer["offload_states_in_rollout"] is False and trainer["reference_offload_param"] is True
    assert "reference_offload_param" not in build(tmp_path, "hf", "7b")["flexrl"]["trainer"]
    for shape in ("3b", "7b"):  # unset: the file's setting
        shipped = json.loads((ROOT / "ds_configs" / f"grpo_vl{shape}_1xh200.json").read_text())
        assert build(tmp_path, "hf", shape)["flexrl"]["trainer"].get("offload_states_in_rollout") == \
            shipped["flexrl"]["trainer"].get("offload_states_in_rollout")
        assert build(tmp_path, "vllm", shape, OFFLOAD_IN_ROLLOUT="1")["flexrl"]["trainer"]["offload_states_in_rollout"]
    assert raw["flexrl"]["rollout"]["hf"] == {"kv_cache": "static", "sleep_level": 1}
    shipped = json.loads((ROOT / "ds_configs" / "grpo_vl7b_1xh200.json").read_text())
    assert build(tmp_path, "vllm", "7b")["zero_optimization"] == shipped["zero_optimization"]


def test_the_sampling_switches_land_in_the_rollout_section(tmp_path):
    raw = build(tmp_path, "vllm", "3b", TEMPERATURE="0.7", TOP_P="0.9", TOP_K="50")
    run = load_run_config_of(raw, tmp_path / "sampling.json")
    assert (run.flexrl.rollout.temperature, run.flexrl.rollout.top_p, run.flexrl.rollout.top_k) == (0.7, 0.9, 50)
    assert run.flexrl.rollout.logprob_diff_caveat() is not None  # what the run prints at start
    shipped = json.loads((ROOT / "ds_configs" / "grpo_vl3b_1xh200.json").read_text())["flexrl"]["rollout"]
    unset = build(tmp_path, "vllm", "3b")["flexrl"]["rollout"]
    assert [unset[k] for k in ("temperature", "top_p", "top_k")] == [shipped[k] for k in ("temperature", "top_p", "top_k")]


def test_the_batch_and_profile_switches_land_in_their_sections(tmp_path):
    run = load_run_config_of(build(tmp_path, "vllm", "3b", PROMPTS="16", RESPONSE_LENGTH="512",
                                   MAX_TOKENS_PER_RANK="16384", LOGPROB_MAX_TOKENS_PER_RANK="65536", PROFILE_STEP="1",
                                   VISION_ATTENTION="sdpa", PACK_BELOW="1024", PACK_BUDGET="4096",
                                   ZERO3_PERSISTENCE="100000", ZERO3_PREFETCH="0", ZERO3_REUSE="2e8",
                                   ZERO3_TRACE_WARNINGS="1"),
                             tmp_path / "batch.json")
    assert run.flexrl.trainer.vision_attention == "sdpa"
    assert (run.flexrl.sp.h_pack, run.flexrl.sp.H_pack) == (1024, 4096)
    assert run.deepspeed["zero_optimization"]["stage3_param_persistence_threshold"] == 100000
    assert run.deepspeed["zero_optimization"]["stage3_prefetch_bucket_size"] == 0
    assert run.deepspeed["zero_optimization"]["stage3_max_reuse_distance"] == 200_000_000
    assert run.deepspeed["zero_optimization"]["log_trace_cache_warnings"] is True
    assert "stage3_prefetch_bucket_size" not in build(tmp_path, "vllm", "3b")["zero_optimization"]
    assert load_run_config_of(build(tmp_path, "vllm", "3b"), tmp_path / "plain.json").flexrl.trainer.vision_attention == "varlen"
    assert run.flexrl.sp.logprob_max_tokens_per_rank == 65536
    assert run.flexrl.trainer.profile_step == 1
    assert build(tmp_path, "vllm", "3b")["flexrl"]["trainer"].get("profile_step") is None
    assert run.flexrl.data.loader.global_batch == 16
    assert run.flexrl.rollout.max_response_length == 512
    assert run.flexrl.sp.max_tokens_per_rank == 16384
    shipped = json.loads((ROOT / "ds_configs" / "grpo_vl3b_1xh200.json").read_text())["flexrl"]
    unset = build(tmp_path, "vllm", "3b")["flexrl"]
    assert unset["data"]["loader"]["global_batch"] == shipped["data"]["loader"]["global_batch"]
    assert unset["sp"] == shipped["sp"] and unset["rollout"]["max_response_length"] == shipped["rollout"]["max_response_length"]


def test_the_zero3_leaf_switches_land_in_the_config(tmp_path):
    run = load_run_config_of(build(tmp_path, "vllm", "3b", ZERO3_LEAF_LAYERS="1", ZERO3_GRANULARITY="2e6"),
                             tmp_path / "leaves.json")
    assert run.flexrl.trainer.zero3_leaf_layers is True
    assert run.deepspeed["zero_optimization"]["stage3_module_granularity_threshold"] == 2_000_000
    plain = build(tmp_path, "vllm", "3b", ZERO3_LEAF_LAYERS="0")
    assert load_run_config_of(plain, tmp_path / "plain.json").flexrl.trainer.zero3_leaf_layers is False
    shipped = build(tmp_path, "vllm", "3b")
    assert load_run_config_of(shipped, tmp_path / "shipped.json").flexrl.trainer.zero3_leaf_layers is True
    assert "stage3_module_granularity_threshold" not in plain["zero_optimization"]


def test_the_linear_switch_reaches_deepspeeds_zero_config(tmp_path):
    from deepspeed.runtime.zero.config import get_zero_config

    for value, expected in (("0", False), ("1", True)):
        run = load_run_config_of(build(tmp_path, "vllm", "3b", ZERO3_MEMORY_EFFICIENT_LINEAR=value),
                                 tmp_path / f"linear_{value}.json")
        assert get_zero_config(run.deepspeed).memory_efficient_linear is expected
    assert "memory_efficient_linear" not in build(tmp_path, "vllm", "3b")["zero_optimization"]


def test_separate_engines_share_one_gpu_or_take_whole_ones(tmp_path):
    one = load_run_config_of(build(tmp_path, "vllm", "3b", colocate="0", gpus=1), tmp_path / "one.json")
    assert not one.flexrl.trainer.colocate
    assert (one.flexrl.trainer.num_gpus_per_rank, one.flexrl.rollout.num_gpus_per_engine) == (0.5, 0.5)
    four = load_run_config_of(build(tmp_path, "vllm", "3b", colocate="0", gpus=4), tmp_path / "four.json")
    assert (four.flexrl.trainer.num_policy_ranks, four.flexrl.rollout.num_engines) == (2, 2)
    assert (four.flexrl.trainer.num_gpus_per_rank, four.flexrl.rollout.num_gpus_per_engine) == (1, 1)


def load_run_config_of(raw: dict, path: Path):
    path.write_text(json.dumps(raw))
    return load_run_config(path)


@pytest.mark.parametrize("shape", ["3b", "7b"])
def test_card_h100_takes_the_80gb_files(tmp_path, shape):
    shipped = json.loads((ROOT / "ds_configs" / f"grpo_vl{shape}_1xh100.json").read_text())
    raw = build(tmp_path, "vllm", shape, CARD="h100")
    load_run_config(tmp_path / f"{shape}_vllm_1_1.json")
    assert raw["zero_optimization"] == shipped["zero_optimization"]
    assert raw["flexrl"]["trainer"]["activation_checkpointing"]  # the file's, CKPT unset
    assert raw["flexrl"]["trainer"]["offload_states_in_rollout"]
    assert not build(tmp_path, "vllm", shape, CARD="h100", CKPT="0")["flexrl"]["trainer"]["activation_checkpointing"]


def test_the_loading_switch_picks_the_central_baseline(tmp_path):
    raw = build(tmp_path, "vllm", "3b", LOADING="central")
    assert raw["flexrl"]["data"]["loading"] == "central"
    assert load_run_config(tmp_path / "3b_vllm_1_1.json").flexrl.data.loading == "central"
