"""`flexrl bench trl-peer` (bench/trl_peer.py, bench/trl_peer_report.py).

The settings and records parts need no TRL. The run itself is skipped unless `trl` imports: TRL is
not a dependency of the project. To run it here without touching the shared install:
`pip install --target /tmp/trlsite --no-deps trl==1.16.0 accelerate datasets pandas dill multiprocess xxhash`
and `PYTHONPATH=$PWD:/tmp/trlsite`.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from flexrl_ds.bench.datasets import make_dataset
from flexrl_ds.bench.trl_peer import TrlPeerConfig, peer_records
from flexrl_ds.bench.trl_peer_report import OurSettings, differences, grpo_arguments, step_figures
from flexrl_ds.config.flexrl_config import load_run_config
from flexrl_ds.media.bad_records import EpochOrder
from flexrl_ds.media.records import read_dataset

ROOT = Path(__file__).resolve().parents[3]
RUN_CONFIG = ROOT / "ds_configs" / "grpo_vl3b_1xh100.json"


def test_arguments_copy_the_run_config():
    run = load_run_config(RUN_CONFIG)
    raw = json.loads(RUN_CONFIG.read_text())
    ours = OurSettings.from_run_config(run.deepspeed, run.flexrl)
    arguments = grpo_arguments(ours, None, use_vllm=True, suppressed_token_ids=[7, 9])
    assert arguments["learning_rate"] == raw["optimizer"]["params"]["lr"]
    assert (arguments["adam_beta1"], arguments["adam_beta2"]) == tuple(raw["optimizer"]["params"]["betas"])
    assert arguments["max_grad_norm"] == raw["gradient_clipping"]
    assert arguments["beta"] == raw["flexrl"]["rl"]["init_kl_coef"]
    assert (arguments["epsilon"], arguments["epsilon_high"]) == (raw["flexrl"]["rl"]["eps_clip_low"],
                                                                  raw["flexrl"]["rl"]["eps_clip_high"])
    assert arguments["gradient_checkpointing"] == raw["flexrl"]["trainer"]["activation_checkpointing"]
    assert arguments["vllm_gpu_memory_utilization"] == raw["flexrl"]["rollout"]["vllm"]["gpu_memory_utilization"]
    assert arguments["generation_kwargs"] == {"logit_bias": {7: -100.0, 9: -100.0}}
    assert grpo_arguments(ours, 3e-6, False, [7])["generation_kwargs"] == {"suppress_tokens": [7]}
    assert grpo_arguments(ours, 3e-6, False, [7])["learning_rate"] == 3e-6
    assert ours.reward_fn == raw["flexrl"]["rl"]["reward_fn"]
    lines = differences(ours, use_vllm=True, dtype="bfloat16", micro_batch=4, dropped_videos=3)
    text = "\n".join(lines)
    share = raw["zero_optimization"]["offload_optimizer"]["ratio"]
    assert f"ZeRO-stage {raw['zero_optimization']['stage']}" in text and f"{share:.0%} of it on the host" in text
    assert "vLLM colocate" in text and "3 video record(s)" in text


def test_step_figures_use_the_trainers_definitions():
    figures = step_figures(3, 2.0, [5, 7, 0], [1.0, 0.0, 0.5], 100.0, 400.0,
                           {"completions/mean_length": 4.0, "step_time": 1.5}, (2**30, 3 * 2**30))
    assert (figures.generated_tokens, figures.prompt_tokens) == (12, 300 - 12)
    assert figures.tokens_per_gpu_s == pytest.approx(300 / 2.0)
    assert (figures.peak_allocated_gb, figures.peak_device_used_gb) == (1.0, 3.0)
    assert figures.reward_mean == pytest.approx(0.5) and figures.trl_step_time == 1.5


def test_records_follow_our_loader_order_without_videos(tmp_path):
    make_dataset(tmp_path, "video-heavy", 12, seed=3, task="keyword")
    rows = read_dataset(tmp_path / "train.jsonl")
    order = EpochOrder(len(rows), seed=5, shuffle=True)
    expected = [rows[i] for _ in range(2) for i in order.take(3)]
    ours = OurSettings(loader_seed=5)
    config = TrlPeerConfig(model="unused", data=str(tmp_path / "train.jsonl"), prompts_per_step=3, steps=2)
    images = [r for r in expected if all(item.kind == "image" for item in r.items)]
    if len(images) < 6:
        with pytest.raises(ValueError, match="only-image"):
            peer_records(str(tmp_path / "train.jsonl"), ours, config)
    make_dataset(tmp_path / "img", "only-image", 12, seed=3, task="keyword")
    rows = read_dataset(tmp_path / "img" / "train.jsonl")
    assert all(r.items and all(item.kind == "image" for item in r.items) for r in rows)
    order = EpochOrder(len(rows), seed=5, shuffle=True)
    records, dropped = peer_records(str(tmp_path / "img" / "train.jsonl"), ours, config)
    assert [r.id for r in records] == [rows[i].id for _ in range(2) for i in order.take(3)] and dropped == 0


def _processor_without_torchvision(model_dir: Path):
    """transformers' Qwen2.5-VL processor for TRL, left-padded as TRL loads it, built without the
    video processor (AutoProcessor needs torchvision, absent from the CPU install here)."""
    import transformers
    from transformers import Qwen2_5_VLProcessor

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, padding_side="left", truncation_side="left")
    processor = Qwen2_5_VLProcessor.__new__(Qwen2_5_VLProcessor)
    processor.tokenizer, processor.video_processor = tokenizer, None
    processor.image_processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(model_dir)
    processor.chat_template = tokenizer.chat_template
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = tokenizer.convert_tokens_to_ids(processor.image_token)
    processor.video_token_id = tokenizer.convert_tokens_to_ids(processor.video_token)
    processor.vision_start_token, processor.vision_end_token = "<|vision_start|>", "<|vision_end|>"
    return processor


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="TRL is not installed (not a dependency)")
def test_two_trl_steps_on_images(tmp_path):
    from PIL import Image

    from flexrl_ds.bench.trl_peer import run_trl_peer, write_result
    from flexrl_ds.cli.main import main

    assert main(["make-tiny-model", "--out", str(tmp_path / "model")]) == 0
    make_dataset(tmp_path / "data", "only-image", 8, seed=0, task="keyword")
    config = TrlPeerConfig(model=str(tmp_path / "model"), data=str(tmp_path / "data" / "train.jsonl"),
                           run_config=str(RUN_CONFIG), prompts_per_step=2, samples_per_prompt=2, response_length=8,
                           steps=2, rollout="hf", dtype="float32", work_dir=str(tmp_path / "trl"),
                           extra_args={"use_cpu": True})
    processor = _processor_without_torchvision(tmp_path / "model")
    result = run_trl_peer(config, processing_class=processor)
    text = write_result(result, str(tmp_path / "out.json"), str(tmp_path / "out.txt"))
    assert json.loads((tmp_path / "out.json").read_text())["steps"] == result["steps"] and "What differs" in text
    records = {r.id: r for r in read_dataset(tmp_path / "data" / "train.jsonl")}
    order = EpochOrder(len(records), seed=0, shuffle=True)
    ids = list(records)
    assert len(result["steps"]) == 2
    for step, step_ids in zip(result["steps"], result["setup"]["record_ids"]):
        # the step's prompts are our loader's, each sampled twice
        assert sorted(step_ids) == sorted(ids[i] for i in order.take(2) for _ in range(2))
        assert step["num_completions"] == 4
        # generated tokens (what the reward got) == TRL's completion mask
        assert step["generated_tokens"] == pytest.approx(step["trl_mean_length"] * 4)
        assert 4 <= step["generated_tokens"] <= 4 * 8
        # prompt tokens == transformers' processor on each prompt (an image block at each marker), once
        # per completion
        expected = 0
        for record_id in step_ids:
            record, images = records[record_id], iter(records[record_id].items)
            content = [{"type": "image", "image": Image.open(next(images).path).convert("RGB")} if piece == "<image>"
                       else {"type": "text", "text": piece} for piece in re.split(r"(<image>)", record.prompt) if piece]
            rendered = processor.apply_chat_template([[{"role": "user", "content": content}]],
                                                     add_generation_prompt=True, tokenize=True, return_dict=True)
            expected += len(rendered["input_ids"][0])
        assert step["prompt_tokens"] == expected
        assert step["tokens_per_gpu_s"] == pytest.approx(
            (step["prompt_tokens"] + step["generated_tokens"]) / step["step_s"])
