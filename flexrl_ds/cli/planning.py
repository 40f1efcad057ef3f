"""Planner commands: `flexrl make-workload`, `flexrl plan`, `flexrl simulate`, `flexrl bench planner`."""

from __future__ import annotations

import argparse


def register(commands, bench) -> None:
    make = commands.add_parser("make-workload",
                               help="generate a seeded GRPO workload file (mixes: flexrl_ds/bench/workloads.py)")
    make.add_argument("--mix", required=True, help="image-heavy | video-heavy | only-video")
    make.add_argument("--num", type=int, required=True, help="number of sequences")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--n-samples", type=int, default=8, help="samples per prompt (share prompt + vision)")
    make.add_argument("--out", required=True, help="output workload JSON")
    make.set_defaults(func=lambda args: _commands().make_workload_command(args))

    plan = commands.add_parser("plan", help="plan one step: degrees, groups, packs, HSF order (micro-batches where "
                                            "the step overflows --max-tokens-per-rank, as flexrl train cuts it)")
    plan.add_argument("--workload", required=True, help="workload JSON (docs/PLAN_SCHEMA.md)")
    plan.add_argument("--world-size", type=int, required=True, help="ranks of the SP domain")
    _add_sp_options(plan)
    plan.add_argument("--out", help="write the plan JSON here (micro-batches: STEM_microI.json each)")
    plan.add_argument("--json", action="store_true",
                      help="print the summary as JSON (micro-batches: {\"micro_batches\": [summary, ...]})")
    plan.set_defaults(func=lambda args: _commands().plan(args))

    sim = commands.add_parser("simulate", help="FlexUlysses vs bucketing vs fixed SP on generated steps")
    sim.add_argument("--mix", required=True, help="image-heavy | video-heavy | only-video")
    sim.add_argument("--world-size", type=int, help="ranks of the SP domain (or --world-sizes)")
    sim.add_argument("--world-sizes", type=_int_list,
                     help="PROJECTION sweep, e.g. 8,16,32,64,128: step time and its breakdown per method at each size "
                          "(needs a calibration with step-time fits)")
    sim.add_argument("--fixed-gbs", action="store_true",
                     help="with --world-sizes: the same --gbs at every size (default: --gbs at the smallest size, "
                          "scaled with the GPU count, i.e. the same load per GPU)")
    sim.add_argument("--gbs", type=int, required=True, help="prompts per step")
    sim.add_argument("--n-samples", type=int, default=8, help="samples per prompt")
    sim.add_argument("--seeds", type=int, default=3, help="steps (seeds 0..K-1) to average over")
    sim.add_argument("--plot", help="write a PNG of per-rank loads per method (seed 0); with --world-sizes the "
                     "projected step-time breakdown per method vs GPU count")
    sim.add_argument("--json", action="store_true", help="print results as JSON")
    sim.add_argument("--extra-p-max", default="auto",
                     help="extra FlexUlysses rows with these degree caps (comma list), 'auto' (the widest the "
                          "world size and head count allow, if above --p-max) or 'none'")
    _add_sp_options(sim)
    sim.set_defaults(func=lambda args: _commands().simulate_command(args))

    bench_planner = bench.add_parser("planner", help="planning time and plan quality, 64..2048 seqs x 8..128 ranks")
    bench_planner.add_argument("--json", action="store_true", help="print results as JSON")
    bench_planner.add_argument("--repeats", type=int, default=7, help="timed runs per cell (median)")
    bench_planner.add_argument("--timing-mix", default="image-heavy", help="mix used for timing")
    bench_planner.add_argument("--seeds", type=int, default=3, help="seeds per quality cell")
    bench_planner.add_argument("--no-quality", action="store_true", help="timing only")
    bench_planner.add_argument("--no-timing", action="store_true", help="quality only")
    bench_planner.add_argument("--counts", type=_int_list, help="sequence counts, comma-separated (default 64..2048)")
    bench_planner.add_argument("--world-sizes", type=_int_list, help="world sizes, comma-separated (default 8..128)")
    _add_sp_options(bench_planner)
    bench_planner.set_defaults(func=lambda args: _commands().bench_planner(args))


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _add_sp_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("planning options (override the config's flexrl.sp section)")
    group.add_argument("--config", help="DeepSpeed JSON with a flexrl section")
    group.add_argument("--model", help="qwen2.5-vl-7b | qwen2.5-vl-32b | mimo-vl-7b | path to config.json/dir")
    group.add_argument("--calibration", help="calibration JSON (see flexrl_ds/planning/cost_model.py), 'auto' (the "
                       "shipped file matching --device and the model; the default) or 'none' (FLOP formula)")
    group.add_argument("--device", help="accelerator name the 'auto' calibration must match (default: the local "
                       "GPU's, none on a machine without one), e.g. 'NVIDIA H200' to project for it")
    group.add_argument("--p-max", type=int, help="largest Ulysses degree (power of two); default 8")
    group.add_argument("--max-tokens-per-rank", type=int, help="per-rank token cap")
    group.add_argument("--h-pack", type=int, help="sequences shorter than this are packed")
    group.add_argument("--H-pack", type=int, help="token budget of one pack")
    group.add_argument("--oversize", choices=("error", "drop", "truncate"), help="sequence too long at p_max")
    group.add_argument("--head-rule", choices=("uneven", "divisible"), default="uneven",
                       help="allow degrees not dividing the head count (uneven-heads all-to-all) or not")
    links = parser.add_argument_group("all-to-all links (override the calibration's; overridden figures are assumed)")
    links.add_argument("--gpus-per-node", type=int, help="GPUs sharing NVLink; larger groups cross the network")
    links.add_argument("--nvlink-GBps", type=float, help="GB/s leaving each GPU inside a node (every group size)")
    links.add_argument("--network-GBps", type=float, help="GB/s leaving each GPU across nodes (its NIC)")
    links.add_argument("--network-latency-us", type=float, help="latency of an all-to-all across nodes, us")


def _commands():
    """bench/plan_commands.py, where the handlers are."""
    from flexrl_ds.bench import plan_commands  # lazy: imports numpy (`flexrl --help` stays fast)

    return plan_commands
