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

from test_vllm_engine_gpu import _gpu_sender, assets, logprob_gaps, sync_over_weight_channel  # noqa: E402,F401  (fixture)


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
        transport, sent = nccl_sync_from_third_gpu(engine, assets["a"])
        again = logprob_gaps(engine, assets, seed=5)
        print(f"tensor parallel 2, over NCCL from GPU 2 ({transport}, {sent / 2**20:.1f} MiB): mean |vLLM - HF| "
              f"against a {again['a']:.2e}, against b {again['b']:.2e}")
        assert again["a"] < 1e-2 and again["a"] * 10 < again["b"]
    else:
        print("NCCL to a tensor-parallel engine: skipped, needs a third GPU for the sender")


def nccl_sync_from_third_gpu(engine, model_dir) -> tuple[str, int]:
    """Send `model_dir`'s weights from a policy-rank-0 process on GPU 2 to the engine's two workers
    (GPUs 0 and 1) over the channel; (transport agreed, bytes sent). It must be NCCL."""
    import multiprocessing

    from flexrl_ds.runtime.weight_channel import BETWEEN_GPUS, ChannelAddress

    context = multiprocessing.get_context("spawn")
    ports, results = context.Queue(), context.Queue()
    sender = context.Process(target=_gpu_sender, args=(str(model_dir), ports, results, 2, 3), daemon=True)
    sender.start()
    try:
        port = ports.get(timeout=180)
        assert ports.get(timeout=10) == port  # the sender hands it once per receiver rank: both workers'
        engine.join_weight_channel(ChannelAddress("127.0.0.1", port, 3, timeout_s=120.0, use_gpu=True), 1)
        assert engine.receive_weights() > 0
        transport, sent = results.get(timeout=120)
    finally:
        sender.join(timeout=60)
        if sender.is_alive():
            sender.terminate()
    engine.reset_caches()
    assert transport == BETWEEN_GPUS, sent
    return transport, sent
