"""`flexrl make-tiny-model` and `flexrl logprobs`: model-integration tools of FlexUlysses (issue 3)."""

from __future__ import annotations

import argparse


def register(commands, bench) -> None:
    tiny = commands.add_parser(
        "make-tiny-model",
        help="write a tiny random Qwen2.5-VL / Qwen2 model with a locally built tokenizer and processor",
        description="Tiny random model for tests and demos (no hub access): loads with "
                    "AutoModelForImageTextToText (qwen2.5-vl) or AutoModelForCausalLM (qwen2).",
    )
    tiny.add_argument("--out", required=True, help="output directory")
    tiny.add_argument("--arch", default="qwen2.5-vl", choices=("qwen2.5-vl", "qwen2"))
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    tiny.set_defaults(func=_make_tiny_model)

    logprobs = commands.add_parser(
        "logprobs",
        help="per-token log-probs of each record's response, computed with FlexUlysses over N processes",
        description="Reference/old-policy pass as a tool. Output: one JSON line per record "
                    '{"id", "input_ids", "response_start", "logprobs"}; logprobs[i] is the log-prob '
                    "of input_ids[response_start + i].",
    )
    logprobs.add_argument("--model", required=True, help="HF model directory (e.g. from make-tiny-model)")
    logprobs.add_argument("--data", required=True, help="records (.jsonl or .parquet) with a 'response' field")
    logprobs.add_argument("--nproc", type=int, default=1, help="processes (gloo on CPU, NCCL on GPU)")
    logprobs.add_argument("--p-max", type=int, default=None, help="largest Ulysses degree (default: nproc)")
    logprobs.add_argument("--plan-out", default=None, help="write the plan used (plan-schema.md format)")
    logprobs.add_argument("--plan", default=None,
                          help="use this plan file instead of planning (its sequences must be the record ids)")
    logprobs.add_argument("--out", required=True, help="output .jsonl")
    logprobs.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"))
    logprobs.set_defaults(func=_logprobs)


def _make_tiny_model(args: argparse.Namespace) -> int:
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    out = make_tiny_model(TinyModelConfig(out_dir=args.out, arch=args.arch, seed=args.seed))
    print(f"wrote tiny {args.arch} model, tokenizer and processor files to {out}")
    return 0


def _logprobs(args: argparse.Namespace) -> int:
    from flexrl_ds.rl.logprobs import LogprobsConfig, run_logprobs

    config = LogprobsConfig(model_dir=args.model, data_path=args.data, out_path=args.out,
                            num_procs=args.nproc, p_max=args.p_max, plan_out=args.plan_out, dtype=args.dtype,
                            plan_in=args.plan)
    summary = run_logprobs(config)
    print(summary)
    return 0
