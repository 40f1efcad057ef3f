"""`flexrl make-tiny-model` and `flexrl logprobs`: model-integration tools of FlexUlysses (issue 3)."""

from __future__ import annotations

import argparse

from flexrl_ds.common.output_files import output_file
from flexrl_ds.models.tiny import ARCHES, TinyModelConfig, make_tiny_model


def register(commands, bench) -> None:
    _add_make_tiny_model(commands)

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
    logprobs.add_argument("--plan-out", default=None, help="write the plan used (docs/PLAN_SCHEMA.md format)")
    logprobs.add_argument("--plan", default=None,
                          help="use this plan file instead of planning (its sequences must be the record ids)")
    logprobs.add_argument("--out", required=True, help="output .jsonl")
    logprobs.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"))
    logprobs.add_argument("--response-key", default="response",
                          help="record field with the text to score (default response; e.g. answer)")
    logprobs.add_argument("--loader", default="auto", choices=("auto", "shadow", "local"),
                          help="shadow: Ray preprocessing actors decode the media and each rank pulls only its "
                               "vision units (pixels never pass through this process); local: this process "
                               "decodes everything and sends every sample to every rank (the reference); "
                               "auto (default): shadow when Ray is importable. Shadow joins RAY_ADDRESS if set, "
                               "else starts a local Ray cluster")
    logprobs.add_argument("--actors", type=int, default=None,
                          help="preprocessing actors per Ray node (shadow; default: flexrl.data.pool)")
    logprobs.add_argument("--cpus-per-actor", type=float, default=None,
                          help="Ray CPUs reserved per preprocessing actor (shadow; default: flexrl.data.pool)")
    logprobs.add_argument("--config", default=None,
                          help="DeepSpeed JSON whose flexrl.data section configures the shadow loader "
                               "(pool, bad-record policy, media root, video backend; geometry comes from --model) "
                               "and whose flexrl.sp section the planner (token cap, packing, cost model, "
                               "calibration, oversize; p_max from --p-max / --nproc)")
    logprobs.set_defaults(func=_logprobs)

    _add_bench_update(bench)
    _add_bench_zero3_trace(bench)
    _add_bench_zero3_host(bench)
    _add_bench_step_cost(bench)

    vision = bench.add_parser("vision", help="vision-tower patches per rank: sequence owner vs pack group vs domain")
    vision.add_argument("--mix", default="image-heavy")
    vision.add_argument("--gbs", type=int, default=32, help="prompts in the step")
    vision.add_argument("--n-samples", type=int, default=8, help="GRPO samples per prompt")
    vision.add_argument("--world", type=int, default=32, help="ranks of the SP domain")
    vision.add_argument("--p-max", type=int, default=8)
    vision.add_argument("--seed", type=int, default=0)
    vision.add_argument("--plot", default=None, help="PNG of patches per rank per policy")
    vision.set_defaults(func=_bench_vision)


def _add_make_tiny_model(commands) -> None:
    tiny = commands.add_parser(
        "make-tiny-model",
        help="write a tiny random Qwen2.5-VL / Qwen3-VL / Qwen2 model with a locally built tokenizer and processor",
        description="Tiny random model for tests and demos (no hub access): loads with "
                    "AutoModelForImageTextToText (qwen2.5-vl, qwen3-vl, qwen3-vl-moe) or AutoModelForCausalLM (qwen2).",
    )
    tiny.add_argument("--out", required=True, help="output directory")
    tiny.add_argument("--arch", default="qwen2.5-vl", choices=ARCHES)
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    tiny.add_argument("--vocab-size", type=int, default=None,
                      help="tokenizer entries and embedding / LM-head rows: the trained BPE grown with generated "
                           "filler tokens (151936: Qwen2.5-VL's and Qwen3-VL's); default: the tiny BPE's ~614, "
                           "rows rounded up to 64")
    tiny.set_defaults(func=_make_tiny_model)


def _make_tiny_model(args: argparse.Namespace) -> int:
    out = make_tiny_model(TinyModelConfig(out_dir=args.out, arch=args.arch, seed=args.seed, vocab_size=args.vocab_size))
    print(f"wrote tiny {args.arch} model, tokenizer and processor files to {out}")
    return 0


def _logprobs(args: argparse.Namespace) -> int:
    from flexrl_ds.tools.logprobs import LogprobsConfig, run_logprobs  # lazy: imports torch

    config = LogprobsConfig(model_dir=args.model, data_path=args.data, out_path=args.out,
                            num_procs=args.nproc, p_max=args.p_max, plan_out=args.plan_out, dtype=args.dtype,
                            plan_in=args.plan, response_key=args.response_key, loader=args.loader,
                            num_actors=args.actors, cpus_per_actor=args.cpus_per_actor,
                            run_config=args.config)
    print(run_logprobs(config).summary)
    return 0


def _bench_vision(args: argparse.Namespace) -> int:
    from flexrl_ds.bench.vision_balance_bench import run  # lazy: imports torch (`flexrl --help` stays fast)

    rows = run(args.mix, args.gbs, args.n_samples, args.world, args.p_max, args.seed, args.plot)
    print(f"{'policy':<16}{'max patches':>14}{'mean':>14}{'max/mean':>10}")
    for row in rows:
        print(f"{row.policy:<16}{row.max_patches:>14}{row.mean_patches:>14.0f}{row.balance:>10.3f}")
    if args.plot:
        print(f"plot: {args.plot}")
    return 0


def _add_bench_update(bench) -> None:
    update = bench.add_parser(
        "update", help="one policy update's forward+backward: plain transformers vs FlexUlysses vs its ZeRO-3 engine",
        description="The same samples and weights, timed as plain transformers (one sample at a time, and in "
                    "length-sorted padded micro-batches with a chunked loss), as "
                    "FlexUlyssesLM on one rank, and in the DeepSpeed ZeRO-3 engine of --config (plus its "
                    "optimizer step, its no-grad forward, and the trainer's GRPO update step); seconds, model "
                    "TFLOP/s, MFU on GPUs and each way's loss (flexrl_ds/bench/update_bench.py).")
    update.add_argument("--model", required=True, help="HF model directory")
    update.add_argument("--data", required=True, help="records (.jsonl or .parquet): their prompts and media")
    update.add_argument("--config", required=True, help="run config (DeepSpeed JSON): the engine, and bf16 or not")
    update.add_argument("--response-length", type=int, default=256, help="random response tokens per sample")
    update.add_argument("--samples-per-prompt", type=int, default=4, help="samples per prompt, sharing its media")
    update.add_argument("--max-prompts", type=int, default=None, help="use only the first N records")
    update.add_argument("--repeats", type=int, default=3, help="timed repeats after one warm-up (best is reported)")
    update.add_argument("--checkpointing", action="store_true", help="activation checkpointing in all ways")
    update.add_argument("--ways", default="hf,hf_batched,flexrl,zero3,logprob,grpo",
                        help="comma-separated ways to time, of hf, hf_batched (plain transformers as a careful user "
                             "writes it: length-sorted padded micro-batches, chunked loss), flexrl, zero3 (with its "
                             "optimizer step), logprob (the engine's no-grad forward) and grpo (the trainer's "
                             "update step)")
    update.add_argument("--hf-batch-tokens", type=int, default=16384,
                        help="hf_batched: padded tokens (rows × longest row) per micro-batch")
    update.add_argument("--hf-attention", default="sdpa", choices=("sdpa", "flash_attention_2"),
                        help="the hf ways' attention implementation (flash_attention_2: where flash-attn is installed)")
    update.add_argument("--seed", type=int, default=0)
    update.add_argument("--json", default=None, help="write the result here")
    update.add_argument("--profile", default=None, metavar="DIR",
                        help="after each way's timed repeats, one more run of it under torch.profiler: DIR/<way>.txt "
                             "(its time split by region: vision tower, decoder, lm_head, loss, backward, optimizer "
                             "step; the top ops by device and host time)")
    update.add_argument("--profile-tables-only", action="store_true",
                        help="with --profile: the tables alone, without each way's trace DIR/<way>.json.gz (which "
                             "takes minutes to write for a big run)")
    update.set_defaults(func=_bench_update)


def _bench_update(args: argparse.Namespace) -> int:
    from flexrl_ds.bench.update_bench import UpdateBenchConfig, run_update_bench, write_result  # lazy: torch, DeepSpeed

    config = UpdateBenchConfig(args.model, args.data, args.config, response_length=args.response_length,
                               samples_per_prompt=args.samples_per_prompt, max_prompts=args.max_prompts,
                               repeats=args.repeats, activation_checkpointing=args.checkpointing, seed=args.seed,
                               ways=tuple(way.strip() for way in args.ways.split(",") if way.strip()),
                               profile_dir=args.profile, profile_trace=not args.profile_tables_only,
                               hf_batch_tokens=args.hf_batch_tokens, hf_attention=args.hf_attention)
    if args.json:
        output_file(args.json)  # a folder in the way is named now, not after the benchmark
    write_result(run_update_bench(config), args.json)
    return 0


def _add_bench_zero3_trace(bench) -> None:
    trace = bench.add_parser(
        "zero3-trace", help="host time of ZeRO-3's passes by stage3_max_reuse_distance (the first pass on a trace)",
        description="A chain of small blocks in a one-rank ZeRO-3 engine per reuse distance, timed over no-grad "
                    "passes: pass 1 records the module trace, pass 2 is the first on it (it works out, for every "
                    "module, which parameters to keep gathered), the rest are steady "
                    "(flexrl_ds/bench/zero3_trace_bench.py).")
    trace.add_argument("--blocks", type=int, default=200, help="blocks of the chain (a norm and two linears each)")
    trace.add_argument("--width", type=int, default=64, help="width of each block's layers")
    trace.add_argument("--reuse", default="1e9,1e5,0",
                       help="comma-separated stage3_max_reuse_distance values, in elements (1e9: DeepSpeed's default)")
    trace.add_argument("--passes", type=int, default=4, help="no-grad passes per engine (at least 3)")
    trace.set_defaults(func=_bench_zero3_trace)


def _bench_zero3_trace(args: argparse.Namespace) -> int:
    # lazy: its run imports DeepSpeed
    from flexrl_ds.bench.zero3_trace_bench import TraceBenchConfig, format_rows, run_trace_bench

    try:
        distances = tuple(float(value) for value in args.reuse.split(",") if value.strip())
    except ValueError as error:
        raise ValueError(f"--reuse: comma-separated numbers of elements, got {args.reuse!r}") from error
    config = TraceBenchConfig(args.blocks, args.width, distances, args.passes)
    print(format_rows(run_trace_bench(config)))
    return 0


def _add_module_tree_args(parser, work_dir: str, config_help: str) -> None:
    """The options of the benches on a real shape's module tree at tiny widths (bench/zero3_host_bench.py)."""
    parser.add_argument("--work-dir", default=work_dir, help="where the models and data are written")
    parser.add_argument("--config", default="ds_configs/grpo_vl3b_1xh100.json", help=config_help)
    parser.add_argument("--shape", default="3b", help="whose module tree (bench/rollout_bench.py SHAPES)")


def _add_bench_zero3_host(bench) -> None:
    host = bench.add_parser(
        "zero3-host", help="host seconds of ZeRO-3's hooks per micro-batch on one rank, per setting, against the "
                           "bare module",
        description="A real shape's module tree at tiny widths, one rank: the bare FlexUlysses module's forward and "
                    "backward against a ZeRO-3 engine's per setting, with DeepSpeed's hook, fetch, release and "
                    "gather calls counted (flexrl_ds/bench/zero3_host_bench.py).")
    _add_module_tree_args(host, "/tmp/flexrl-zero3-host",
                          "run config: its zero_optimization is each setting's base, its flexrl.sp the micro-batches")
    host.add_argument("--settings", default=None, help="comma-separated names (default: all; see the module)")
    host.add_argument("--prompts", type=int, default=8, help="records of the generated scoring set")
    host.add_argument("--samples-per-prompt", type=int, default=2)
    host.add_argument("--response-length", type=int, default=64)
    host.add_argument("--repeats", type=int, default=5, help="timed passes per way (the best is its figure)")
    host.add_argument("--checkpointing", choices=("config", "on", "off"), default="config",
                      help="activation checkpointing (config: the run config's)")
    host.add_argument("--json", default=None, help="write the result here")
    host.set_defaults(func=_bench_zero3_host)


def _bench_zero3_host(args: argparse.Namespace) -> int:
    import json

    # lazy: its run imports torch and DeepSpeed
    from flexrl_ds.bench.zero3_host_bench import SETTINGS, HostBenchConfig, format_result, result_json, run_host_bench

    settings = tuple(name.strip() for name in args.settings.split(",") if name.strip()) if args.settings \
        else tuple(SETTINGS)
    checkpointing = None if args.checkpointing == "config" else args.checkpointing == "on"
    config = HostBenchConfig(args.work_dir, args.config, args.shape, settings, args.prompts, args.samples_per_prompt,
                             args.response_length, args.repeats, checkpointing=checkpointing)
    result = run_host_bench(config)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result_json(result), handle, indent=1)
    return 0


def _add_bench_step_cost(bench) -> None:
    cost = bench.add_parser(
        "step-cost", help="the trainer's train_step beyond the ZeRO-3 engine, per micro-batch on one rank: its "
                          "parts' host seconds and its device reads",
        description="zero3-host's model (a real shape's module tree at tiny widths), one shipped-settings engine: "
                    "the engine's forward+backward and step against train_step, train_step's parts alone, and "
                    "the host syncs of each (flexrl_ds/bench/step_cost_bench.py).")
    _add_module_tree_args(cost, "/tmp/flexrl-step-cost", "run config (its ZeRO-3 settings, flexrl.sp and flexrl.rl)")
    cost.add_argument("--prompts", type=int, default=4, help="records of the generated scoring set")
    cost.add_argument("--response-length", type=int, default=32)
    cost.add_argument("--repeats", type=int, default=3, help="timed passes per way (the best is its figure)")
    cost.add_argument("--json", default=None, help="write the result here")
    cost.set_defaults(func=_bench_step_cost)


def _bench_step_cost(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    # lazy: its run imports torch and DeepSpeed
    from flexrl_ds.bench.step_cost_bench import run_step_cost_bench
    # lazy: as above (the config imports the bench module, which imports torch)
    from flexrl_ds.bench.zero3_host_bench import HostBenchConfig

    config = HostBenchConfig(args.work_dir, args.config, args.shape, ("shipped",), prompts=args.prompts,
                             response_length=args.response_length, repeats=args.repeats, warmups=1)
    result = run_step_cost_bench(config)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(dataclasses.asdict(result), handle, indent=1)
    return 0
