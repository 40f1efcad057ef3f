"""The environment the driver hands to policy ranks and rollout engines (Ray actors)."""

from flexrl_ds.trainer.launch import worker_env


def test_worker_env_forwards_nccl_vllm_and_the_listed_settings_only():
    environ = {"NCCL_NVLS_ENABLE": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "VLLM_USE_FLASHINFER_SAMPLER": "0",
               "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HOME": "/root", "PATH": "/usr/bin",
               "MY_NCCL_NOTE": "x", "CUDA_VISIBLE_DEVICES": "0,1", "VLLM_HOST_IP": "10.0.0.1", "VLLM_PORT": "5000",
               "VLLM_DP_RANK": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert worker_env(environ) == {"NCCL_NVLS_ENABLE": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
                                   "VLLM_USE_FLASHINFER_SAMPLER": "0", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                                   "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def test_worker_env_reads_the_process_environment_by_default(monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    forwarded = worker_env()
    assert forwarded["NCCL_DEBUG"] == "WARN" and "OMP_NUM_THREADS" not in forwarded
