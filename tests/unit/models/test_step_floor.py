"""The step floor (models/step_floor.py) against hand-computed cases, the rollout floor of
bench/rollout_floor.py, the vision tower's real weights, and the driver's metrics and console line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flexrl_ds.bench.rollout_floor import Peaks, rollout_floor
from flexrl_ds.models.flops import DecoderShape, VisionShape
from flexrl_ds.models.step_floor import (DevicePeaks, PromptTokens, peak_hbm_bytes, step_floor, vision_params)
from flexrl_ds.trainer.floor_metrics import floor_metrics, floor_text, job_gpus
from flexrl_ds.trainer.metrics import progress_line

# hidden 4, 2 query heads, 1 KV head, 1 layer, MLP 8, vocabulary 10, head_dim 2. By hand:
#   one layer's matmul weights: q, o 2·4·2·2 = 32; k, v 2·4·1·2 = 16; MLP 3·4·8 = 96: 144
#   LM head 10·4 = 40; all matmul weights 184 (368 bytes); KV cache 1·2·1·2·2 = 8 bytes per token;
#   attention 1·4·2·2 = 16 FLOPs per (query, key) pair.
SHAPE = DecoderShape(hidden_size=4, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=1,
                     intermediate_size=8, vocab_size=10, head_dim=2)
# Prompt A: 3 tokens, samples of 2 and 1 response tokens; prompt B: 2 tokens, one sample of 3.
PROMPTS = [PromptTokens(3, (2, 1)), PromptTokens(2, (3,))]


def test_hand_computed_compute_bound_step():
    floor = step_floor(SHAPE, PROMPTS, DevicePeaks(flops_per_s=100.0, bytes_per_s=1000.0), logprob_passes=2)
    # prefill: A 2·144·3 + 16·3·4/2 + 2·40 = 864 + 96 + 80 = 1040; B 576 + 48 + 80 = 704: 17.44 s
    # (bytes: 368 + 5 tokens · 8 = 408: 0.408 s)
    assert floor.prefill_s == pytest.approx(17.44)
    # decode step 1: A's 2-token sample at position 3 (4 keys) 2·184 + 16·4 = 432, B's at 2 (3 keys) 416:
    # 8.48 s; step 2: B's at position 3: 432: 4.32 s (bytes 424 and 400: under 0.5 s each)
    assert floor.decode_s == pytest.approx(8.48 + 4.32)
    # one forward: A+2 (5 tokens) 2·144·5 + 16·5·6/2 + 2·40·2 = 1440 + 240 + 160 = 1840;
    # A+1 (4 tokens) 1152 + 160 + 80 = 1392; B+3 (5 tokens) 1440 + 240 + 240 = 1920: 5152 FLOPs
    assert floor.inference_s == pytest.approx(2 * 51.52)
    # forward and backward 3 · 5152 = 15456: 154.56 s; AdamW 184 · 30 bytes: 5.52 s
    assert floor.update_s == pytest.approx(154.56 + 5.52)
    assert floor.sync_s == pytest.approx(2 * 368 / 1000)  # every weight read and written once
    phases = floor.phases()
    assert phases["rollout"] == pytest.approx(17.44 + 12.8)
    assert phases["step"] == pytest.approx(17.44 + 12.8 + 103.04 + 160.08 + 0.736)


def test_hand_computed_memory_bound_step_on_two_gpus():
    floor = step_floor(SHAPE, PROMPTS, DevicePeaks(flops_per_s=1e6, bytes_per_s=100.0), num_gpus=2,
                       logprob_passes=1, other_params=16)
    # 200 weights (184 + 16 of a vision tower): 400 bytes; 2 GPUs: 200 bytes/s together
    assert floor.prefill_s == pytest.approx((400 + 5 * 8) / 200)
    # decode: step 1 reads A's 3 prompt + 1 response tokens, B's 2 + 1: 7 tokens; step 2: B's 2 + 2
    assert floor.decode_s == pytest.approx((400 + 7 * 8) / 200 + (400 + 4 * 8) / 200)
    assert floor.inference_s == pytest.approx(400 / 200)
    assert floor.update_s == pytest.approx(2 * 400 / 200 + 200 * 30 / 200)
    assert floor.sync_s == pytest.approx(2 * 400 / 200)
    assert step_floor(SHAPE, PROMPTS, DevicePeaks(1e6, 100.0), num_gpus=2, logprob_passes=0).inference_s == 0.0


@pytest.mark.parametrize("prompts,prompt_len,new_tokens,peaks", [
    (16, 512, 256, (989.4e12, 4.8e12)), (1, 40, 7, (1e9, 1e12)), (64, 3000, 64, (312e12, 2.0e12))])
def test_rollout_of_equal_prompts_is_bench_rollout_floor(prompts, prompt_len, new_tokens, peaks):
    shape = DecoderShape(2048, 16, 2, 36, 11008, 151936, 128)
    batch = [PromptTokens(prompt_len, (new_tokens,)) for _ in range(prompts)]
    ours = step_floor(shape, batch, DevicePeaks(*peaks))
    theirs = rollout_floor(shape, prompts, prompt_len, new_tokens, Peaks(*peaks))
    assert ours.prefill_s == pytest.approx(theirs.prefill_s, rel=1e-12)
    assert ours.decode_s == pytest.approx(theirs.decode_s, rel=1e-12)


def test_samples_of_a_prompt_share_its_prefill_and_prompt_cache():
    """Four samples of one prompt: the prefill of one; each decode step reads the prompt's KV once."""
    peaks = DevicePeaks(1e15, 1e9)  # memory-bound
    shared = step_floor(SHAPE, [PromptTokens(30, (5, 5, 5, 5))], peaks)
    alone = step_floor(SHAPE, [PromptTokens(30, (5,))], peaks)
    assert shared.prefill_s == alone.prefill_s
    # step k: weights + 30 prompt tokens + 4·k (shared) against 30 + k (alone)
    extra = sum(3 * k * 8 for k in range(1, 5)) / 1e9
    assert shared.decode_s == pytest.approx(alone.decode_s + extra)


def test_vision_params_are_the_towers_matmul_weights(vl_samples):
    visual = vl_samples[0].model.visual
    weights = visual.patch_embed.proj.weight.numel()
    weights += sum(m.weight.numel() for m in visual.blocks.modules() if isinstance(m, torch.nn.Linear))
    weights += sum(m.weight.numel() for m in visual.merger.modules() if isinstance(m, torch.nn.Linear))
    assert vision_params(VisionShape.from_config(vl_samples[0].config.vision_config)) == weights


@pytest.mark.parametrize("name, bandwidth", [("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12),
                                             ("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA A100-SXM4-80GB", 2.039e12),
                                             ("NVIDIA A100-SXM4-40GB", 1.555e12), ("NVIDIA GeForce RTX 3090", None),
                                             (None, None)])
def test_bandwidth_by_gpu_name(name, bandwidth):
    assert peak_hbm_bytes(name) == bandwidth


def _samples():
    prompts = [SimpleNamespace(prompt_ids=[1] * 3, sample_names=["a0", "a1", "a2"]),
               SimpleNamespace(prompt_ids=[1] * 2, sample_names=["b0"])]
    # a2 got no response (withdrawn): not part of the step
    return SimpleNamespace(prompts=prompts, response_ids={"a0": [5, 6], "a1": [7], "b0": [1, 2, 3]})


def test_driver_metrics_and_console_line():
    options = SimpleNamespace(decoder=SHAPE, vision=None, peak_flops=100.0, peak_bytes_per_s=1000.0, floor_gpus=1)
    times = {"data": 1.0, "rollout": 60.5, "reward": 0.1, "inference": 206.08, "update": 320.16, "sync": 1.472,
             "step": 700.0}
    metrics = floor_metrics(options, _samples(), {}, times, logprob_passes=2)
    expected = step_floor(SHAPE, PROMPTS, DevicePeaks(100.0, 1000.0), logprob_passes=2).phases()
    assert metrics["floor_s"] == pytest.approx(expected)
    assert metrics["floor_ratio"] == pytest.approx({phase: times[phase] / expected[phase] for phase in expected})
    assert metrics["floor_ratio"]["inference"] == pytest.approx(2.0) and metrics["floor_ratio"]["sync"] == pytest.approx(2.0)
    ratio = metrics["floor_ratio"]
    assert floor_text(metrics) == (f" | floor ×{ratio['step']:.1f} (rollout ×{ratio['rollout']:.1f}, "
                                   f"inference ×2.0, update ×2.0)")
    row = {"step": 0, "reward_mean": 0.5, "reward_std": 0.1, "loss": 0.2, "kl": 0.0, "clip_frac": 0.0,
           "response_length_mean": 2.0, "time_s": times, "tokens_per_gpu_s": 10.0, **metrics}
    assert progress_line(row, 3).endswith(floor_text(metrics))
    assert floor_metrics(SimpleNamespace(**{**vars(options), "peak_bytes_per_s": None}), _samples(), {}, times, 2) == {}
    assert floor_text({}) == ""


def test_job_gpus_counts_separate_engines():
    def run(colocate, per_rank, engines, per_engine):
        return SimpleNamespace(flexrl=SimpleNamespace(
            trainer=SimpleNamespace(colocate=colocate, num_gpus_per_rank=per_rank),
            rollout=SimpleNamespace(num_engines=engines, num_gpus_per_engine=per_engine)))
    assert job_gpus(run(True, 1.0, 1, 0.0), 8) == 8
    assert job_gpus(run(False, 0.5, 1, 0.5), 1) == 1  # one GPU shared by a rank and an engine
    assert job_gpus(run(False, 1.0, 4, 1.0), 4) == 8
    assert job_gpus(run(True, 0.0, 1, 0.0), 2) == 1  # CPU
