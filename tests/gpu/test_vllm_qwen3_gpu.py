"""The vllm rollout backend with Qwen3-VL, dense and MoE, on a GPU (issue 38), against vLLM 0.26.0.

Small random models (head_dim 64) and the scoring dataset's images and videos (several frame groups,
so several timestamps per video), through the ShadowLoader:
(a) vLLM's expansion of every prompt equals the trainer's token ids (the engine raises otherwise):
    each video's frame groups with their timestamps, each image's pads;
(b) through a level-2 sleep (weights dropped, so every weight must come from the sync; vLLM's DeepStack
    scratch tensors zeroed again) and a weight sync from another seed's model (HF names; the MoE's
    fused experts as transformers holds them), the engine's log-probs match that model's plain HF
    forward on the same tokens, far closer than the engine's first weights do.
One engine per process: `-k dense` and `-k moe` run as two pytest processes
(tests/gpu/run_vllm_on_gpu_machine.sh). Skipped without CUDA or vLLM.
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

# the MoE's expert width (intermediate_size // 2) differs from hidden_size: vLLM tells a fused expert
# tensor's layout from which dim is the hidden size (fused_moe/routed_experts.py `load_weights`)
SMALL = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
             intermediate_size=384, vision_hidden_size=128, vision_depth=2, vision_num_heads=2)


@pytest.fixture(scope="module", params=["qwen3-vl", "qwen3-vl-moe"], ids=["dense", "moe"])
def assets(request, tmp_path_factory):
    from flexrl_ds.models.processing import encode_records
    from flexrl_ds.models.sample_data import write_scoring_dataset
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp(request.param)
    model_a = str(make_tiny_model(TinyModelConfig(out_dir=str(root / "a"), arch=request.param, seed=1, **SMALL)))
    model_b = str(make_tiny_model(TinyModelConfig(out_dir=str(root / "b"), arch=request.param, seed=2, **SMALL)))
    samples = encode_records(model_a, write_scoring_dataset(root / "data", num_records=8, seed=3))
    videos = [item for sample in samples.values() for item in sample.items if item.kind == "video"]
    assert videos and max(item.grid_thw[0] for item in videos) >= 2, "no video of several frame groups"
    return {"a": model_a, "b": model_b, "samples": samples}


def _requests(assets, seed: int = 0):
    from flexrl_ds.rollout.base import RolloutRequest

    return [RolloutRequest(f"{key}/{seed}", sample.input_ids[:sample.response_start].tolist(), list(sample.items), seed)
            for key, sample in assets["samples"].items()]


def _hf_logprobs(model_dir, requests, results):
    from flexrl_ds.models.flex_model import reference_logprobs
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.models.processing import EncodedSample

    model = load_model(model_dir).cuda()
    with torch.no_grad():
        return [reference_logprobs(model, EncodedSample(request.sample_key,
                                                        torch.tensor(request.prompt_ids + result.response_ids),
                                                        len(request.prompt_ids), list(request.items))).cpu()
                for request, result in zip(requests, results)]


def test_qwen3_prompts_and_weight_sync(assets):
    """(a), then (b)."""
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.models.weights import iter_weight_buckets
    from flexrl_ds.rollout.base import SamplingParams
    from flexrl_ds.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(assets["a"], dtype="float32", device="cuda:0", max_batch_sequences=16,
                        gpu_memory_utilization=0.2, enforce_eager=True, sleep_level=2,
                        max_images_per_prompt=4, max_videos_per_prompt=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    assert all(len(r.response_ids) == 8 for r in engine.generate(_requests(assets), params))  # (a)
    policy_b = load_model(assets["b"]).cuda()
    engine.sleep()
    for bucket in iter_weight_buckets(policy_b, 1 << 20, "cuda"):
        engine.load_weights(bucket)
    engine.wake()
    del policy_b
    requests = _requests(assets, seed=3)
    results = engine.generate(requests, params)
    values = [torch.tensor(r.logprobs) for r in results]
    diff_b = torch.cat([(a - b).abs() for a, b in zip(values, _hf_logprobs(assets["b"], requests, results))])
    diff_a = torch.cat([(a - b).abs() for a, b in zip(values, _hf_logprobs(assets["a"], requests, results))])
    print(f"\n{assets['a']} after a level-2 sleep: mean |vLLM - HF| log-prob after syncing model b: "
          f"{diff_b.mean():.2e} against b, {diff_a.mean():.2e} against a (max {diff_b.max():.2e})")
    assert diff_b.mean() < 1e-2 and diff_b.mean() * 10 < diff_a.mean()
