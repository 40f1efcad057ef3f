"""A vllm engine of a run that samples at a temperature other than 1 (its own process: one vLLM
engine per pytest process here). Its log-probs are vLLM's processed ones (rollout/vllm_inputs.py
`logprobs_mode`), which must be those of the HF forward's logits divided by that temperature, what
the trainer computes (top-k and top-p off), far closer than the temperature-1 ones; a request at
another temperature is refused. Run by tests/gpu/run_vllm_on_gpu_machine.sh (tests)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_vllm_engine_gpu import _hf_logprobs, _requests, assets  # noqa: E402,F401  (assets: the module's fixture)

TEMPERATURE = 0.7


def _hf_logprobs_at(model_dir, requests, results, temperature: float) -> torch.Tensor:
    return torch.cat(_hf_logprobs(model_dir, requests, results, temperature))


def test_logprobs_at_the_run_temperature_are_those_of_hf_logits_over_it(assets):  # noqa: F811
    from flexrl_ds.rollout.base import SamplingParams
    from flexrl_ds.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(assets["a"], dtype="float32", device="cuda:0", max_batch_sequences=16,
                        gpu_memory_utilization=0.2, enforce_eager=True, logprob_temperature=TEMPERATURE)
    requests = _requests(assets, seeds=(5,))
    results = engine.generate(requests, SamplingParams(temperature=TEMPERATURE, max_new_tokens=8))
    ours = torch.cat([torch.tensor(r.logprobs) for r in results])
    at_run = (ours - _hf_logprobs_at(assets["a"], requests, results, TEMPERATURE)).abs().mean()
    at_one = (ours - _hf_logprobs_at(assets["a"], requests, results, 1.0)).abs().mean()
    print(f"\nmean |vLLM - HF| log-prob at temperature {TEMPERATURE}: {at_run:.2e} against HF's logits / "
          f"{TEMPERATURE}, {at_one:.2e} against its raw logits")
    assert at_run < 1e-2 and at_run * 10 < at_one
    with pytest.raises(ValueError, match=f"log-probs at temperature {TEMPERATURE}.*asked to sample at 1.0"):
        engine.generate(requests[:1], SamplingParams(temperature=1.0, max_new_tokens=2))
