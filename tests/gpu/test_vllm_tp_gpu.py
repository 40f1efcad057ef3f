"""A tensor-parallel vLLM engine (2 shards, 2 GPUs) as a separate engine: both workers join the
weight channel (ranks 1 and 2) and load the full tensors sent; afterwards the engine's log-probs are
those of the weights sent. Through host memory with the sender in this process; with a third GPU,
also over NCCL from a sender process on it (the transport of separate engines on whole GPUs). Its own pytest run (tests/gpu/run_vllm_on_gpu_machine.sh channel): an
engine of test_vllm_engine_gpu.py leaves a torch.distributed world in the process, where only
whole-model engines may start. Skipped without two GPUs or vLLM."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]

from test_vllm_engine_gpu import assets, logprob_gaps, sync_from_gpu_sender, sync_over_weight_channel  # noqa: E402,F401  (fixture)


def test_tensor_parallel_engine_workers_each_receive_the_weights(assets):  # noqa: F811
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(assets["a"], dtype="float32", max_batch_sequences=16, gpu_memory_utilization=0.2,
                        enforce_eager=True, tensor_parallel_size=2)
    assert engine.channel_ranks == 2
    before = logprob_gaps(engine, assets, seed=5)
    loaded, sent = sync_over_weight_channel(engine, load_model(assets["b"]))
    after = logprob_gaps(engine, assets, seed=5)
    print(f"\ntensor parallel 2, over the weight channel ({loaded} tensors, {sent / 2**20:.1f} MiB): mean |vLLM - HF| "
          f"against a {before['a']:.2e} -> {after['a']:.2e}, against b {before['b']:.2e} -> {after['b']:.2e}")
    assert before["a"] < 1e-2 and after["b"] < 1e-2 and after["b"] * 10 < after["a"]
    if torch.cuda.device_count() >= 3:
        from flexrl_ds.runtime.weight_channel import BETWEEN_GPUS

        loaded, transport, sent = sync_from_gpu_sender(engine, assets["a"], gpu=2)  # the shards are on GPUs 0 and 1
        assert loaded > 0 and transport == BETWEEN_GPUS, sent
        again = logprob_gaps(engine, assets, seed=5)
        print(f"tensor parallel 2, over NCCL from GPU 2 ({loaded} tensors, {sent / 2**20:.1f} MiB): mean |vLLM - HF| "
              f"against a {again['a']:.2e}, against b {again['b']:.2e}")
        assert again["a"] < 1e-2 and again["a"] * 10 < again["b"]
    else:
        print("NCCL to a tensor-parallel engine: skipped, needs a third GPU for the sender")
