"""Probe, one GPU: bare vLLM throughput with the engine core in this process or in its own process.

The trainer's engine runs vLLM in process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) and makes ~7,600
tokens/s on the 7B shape; the bare engine measured with vLLM's defaults (engine core in a process of
its own) made 10,400. This runs both on the same model and prompts, each in a fresh interpreter:
    python3 tests/gpu/probe_vllm_process_mode.py [inproc|separate|cached ...]
"cached" is "inproc" with every prompt's KV already in the prefix cache (no prefill timed): what a
measurement that does not reset the cache after its warm-up on the same prompts reports.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def _one(mode: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if mode == "separate" else "0"
    import torch
    import vllm

    from flexrl_ds.bench.rollout_bench import RolloutBenchConfig, _model_dir

    config = RolloutBenchConfig(shape="7b")
    llm = vllm.LLM(model=str(_model_dir(config)), dtype="bfloat16", gpu_memory_utilization=0.4,
                   load_format="dummy", max_num_seqs=64, enable_sleep_mode=True, enable_prefix_caching=True,
                   seed=0, limit_mm_per_prompt={"image": 4, "video": 1})
    ids = torch.randint(0, 600, (64, 512), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [{"prompt_token_ids": row} for row in ids]
    sampling = vllm.SamplingParams(temperature=1.0, max_tokens=256, ignore_eos=True, detokenize=False)
    llm.generate(prompts if mode == "cached" else prompts[:2], sampling, use_tqdm=False)
    for repeat in range(2):
        if mode != "cached":
            llm.reset_prefix_cache()
        started = time.perf_counter()
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        seconds = time.perf_counter() - started
        tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
        print(f"[probe] mode={mode} repeat={repeat} {tokens} tokens in {seconds:.2f} s = "
              f"{tokens / seconds:,.0f} tokens/s", flush=True)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[1].startswith("--one="):
        _one(argv[1].split("=", 1)[1])
        return 0
    status = 0
    for mode in argv[1:] or ["inproc", "separate", "inproc", "separate"]:
        done = subprocess.run([sys.executable, __file__, f"--one={mode}"], capture_output=True, text=True)
        lines = [line for line in (done.stdout + done.stderr).splitlines() if "[probe]" in line or "Error" in line]
        print("\n".join(lines[-6:]) or f"[probe] mode={mode}: no output (rc {done.returncode})", flush=True)
        status = status or done.returncode
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
