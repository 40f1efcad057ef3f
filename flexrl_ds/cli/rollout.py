"""Rollout commands: `flexrl bench rollout` (flexrl_ds/bench/rollout_bench.py) and `flexrl bench
channel` (the weight channel's transports, flexrl_ds/bench/channel_bench.py)."""

from __future__ import annotations

import json
from pathlib import Path

from flexrl_ds.bench.rollout_plot import floor_lines, plot_rollout, speedups
from flexrl_ds.common.output_files import output_file


def register(commands, bench) -> None:
    rollout = bench.add_parser("rollout", help="rollout engines (hf vs vllm) on one GPU, and a colocated weight sync")
    rollout.add_argument("--shape", default="7b", help="model shape: 7b | 3b | tiny (Qwen2.5-VL, random bf16 weights)")
    rollout.add_argument("--prompts", type=int, default=64, help="prompts in the batch")
    rollout.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt")
    rollout.add_argument("--new-tokens", type=int, default=256, help="tokens generated per prompt (EOS off)")
    rollout.add_argument("--backends", default="hf,vllm", help="comma list of engines to time")
    rollout.add_argument("--bucket-mb", type=int, default=512, help="weight-sync bucket size (MiB)")
    rollout.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="vLLM's share of the GPU")
    rollout.add_argument("--work-dir", default="/tmp/flexrl-rollout-bench", help="where the model config is written")
    rollout.add_argument("--repeats", type=int, default=3, help="timings per engine (the best is its figure)")
    rollout.add_argument("--hf-kv-caches", default="dynamic,static",
                         help="hf engine KV caches to time (dynamic,static)")
    rollout.add_argument("--json", help="write the result JSON here")
    rollout.add_argument("--plot", help="draw every engine's tokens/s into this PNG")
    rollout.add_argument("--from-json", help="no run: report and --plot a result JSON written before (no GPU needed)")
    rollout.set_defaults(func=_bench_rollout)
    channel = bench.add_parser("channel",
                               help="weight channel to separate engines: its transports timed against each other")
    channel.add_argument("--gib", type=float, default=6.0, help="bf16 weights per sync (GiB; 6: a 3B-shaped policy)")
    channel.add_argument("--tensor-mb", type=float, default=64.0, help="size of each tensor (MiB)")
    channel.add_argument("--bucket-mb", type=float, default=512.0, help="bucket size (MiB), as flexrl.trainer's")
    channel.add_argument("--receivers", type=int, default=1, help="receiving processes (engine workers)")
    channel.add_argument("--rounds", type=int, default=3, help="syncs per transport")
    channel.add_argument("--json", help="write the results JSON here")
    channel.set_defaults(func=_bench_channel)


def _bench_rollout(args) -> int:
    if args.from_json:
        result = _saved_result(args.from_json)
    else:
        # lazy: imports torch (`flexrl --help` stays fast)
        from flexrl_ds.bench.rollout_bench import RolloutBenchConfig, run_rollout_bench, write_result

        config = RolloutBenchConfig(args.shape, args.prompts, args.prompt_len, args.new_tokens,
                                    tuple(b for b in args.backends.split(",") if b), args.bucket_mb,
                                    args.gpu_memory_utilization, args.work_dir, repeats=args.repeats,
                                    hf_kv_caches=tuple(c for c in args.hf_kv_caches.split(",") if c))
        ran = run_rollout_bench(config)
        write_result(ran, args.json)
        result = ran.to_json()
    for line in speedup_lines(result["tokens_per_s"]) + floor_lines(result):
        print(f"[bench rollout] {line}")
    if args.plot:
        plot_rollout(result, args.plot)
        print(f"[bench rollout] plot: {args.plot}")
    if not args.from_json:
        print(json.dumps(result))
    return 0


def _saved_result(path: str) -> dict:
    """A result JSON of an earlier run, checked for what the report and the plot read."""
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise SystemExit(f"--from-json {path}: cannot read a result ({error})") from None
    missing = [key for key in ("tokens_per_s", "seconds", "timings_s") if not isinstance(result.get(key), dict)]
    if missing:
        raise SystemExit(f"--from-json {path}: not a `flexrl bench rollout` result (no {', '.join(missing)})")
    if not result["tokens_per_s"]:
        raise SystemExit(f"--from-json {path}: no engine timed")
    untimed = [name for name in result["tokens_per_s"]
               if name not in result["timings_s"] or name not in result["seconds"]]
    if untimed:
        raise SystemExit(f"--from-json {path}: engines without timings: {', '.join(untimed)}")
    return result


def speedup_lines(tokens_per_s: dict[str, float]) -> list[str]:
    """One line per engine with an hf baseline in the result (`bench/rollout_plot.speedups`)."""
    return [f"{name} / {baseline} = {ratio:.1f}x" for name, (baseline, ratio) in speedups(tokens_per_s).items()]


def _bench_channel(args) -> int:
    # lazy: imports torch (`flexrl --help` stays fast)
    from flexrl_ds.bench.channel_bench import ChannelBenchConfig, run_channel_bench

    rows = run_channel_bench(ChannelBenchConfig(total_gib=args.gib, tensor_mib=args.tensor_mb,
                                                bucket_mib=args.bucket_mb, receivers=args.receivers,
                                                rounds=args.rounds))
    if args.json:
        output_file(args.json).write_text(json.dumps(rows, indent=1))
    if not all(row["checksums_match"] for row in rows):
        print("[bench channel] a receiver's weights differ from the sender's", flush=True)
        return 1
    return 0
