"""Peer trainers on our data and shapes: `flexrl bench trl-peer` (TRL's GRPOTrainer,
flexrl_ds/bench/trl_peer.py)."""

from __future__ import annotations


def register(commands, bench) -> None:
    peer = bench.add_parser(
        "trl-peer", help="TRL's GRPOTrainer on the same model, prompts, lengths and batch as a flexrl run",
        description="Runs TRL's GRPOTrainer (TRL 1.16.0, installed apart: pip install trl==1.16.0, or "
                    "scripts/fetch-trl-wheels.sh for the GPU machine) on the image records of --data in our loader's "
                    "order, with the run config's optimizer, clip, KL, checkpointing, sampling and built-in reward; "
                    "vLLM colocate mode where vLLM imports, else HF generate. Prints per step the time, generated "
                    "tokens, tokens/GPU/s and peak device memory, and what differs from `flexrl train` "
                    "(flexrl_ds/bench/trl_peer.py).")
    peer.add_argument("--model", required=True,
                      help="HF model folder (as tests/gpu/run_trainer_on_gpu_machine.sh builds)")
    peer.add_argument("--data", required=True, help="dataset file (train.jsonl of `flexrl make-dataset`)")
    peer.add_argument("--config", default=None,
                      help="our run config (ds_configs/*.json) whose settings the peer copies")
    peer.add_argument("--prompts", type=int, default=None, help="prompts per step (default: the run config's)")
    peer.add_argument("--samples-per-prompt", type=int, default=None,
                      help="completions per prompt (default: the run config's)")
    peer.add_argument("--response-length", type=int, default=None,
                      help="most tokens per completion (default: the run config's)")
    peer.add_argument("--steps", type=int, default=2, help="optimizer steps")
    peer.add_argument("--lr", type=float, default=None, help="learning rate (default: the run config's)")
    peer.add_argument("--rollout", choices=("auto", "vllm", "hf"), default="auto",
                      help="vllm: TRL's vLLM colocate mode; hf: HF generate; auto: vllm where it imports on a GPU")
    peer.add_argument("--micro-batch", type=int, default=None,
                      help="completions per forward/backward (default: --samples-per-prompt)")
    peer.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                      help="the model's dtype in TRL (bfloat16: bf16 weights and AdamW states)")
    peer.add_argument("--work-dir", default="/tmp/flexrl-trl-peer", help="TRL's output_dir (nothing is saved)")
    peer.add_argument("--json", default=None, help="write the result JSON here")
    peer.add_argument("--text", default=None, help="write the table and the differences here")
    peer.set_defaults(func=_bench_trl_peer)


def _bench_trl_peer(args) -> int:
    from flexrl_ds.bench.trl_peer import TrlPeerConfig, run_trl_peer, write_result  # lazy: torch, TRL

    config = TrlPeerConfig(model=args.model, data=args.data, run_config=args.config, prompts_per_step=args.prompts,
                           samples_per_prompt=args.samples_per_prompt, response_length=args.response_length,
                           steps=args.steps, learning_rate=args.lr, rollout=args.rollout,
                           micro_batch=args.micro_batch, dtype=args.dtype, work_dir=args.work_dir)
    print(write_result(run_trl_peer(config), args.json, args.text))
    return 0
