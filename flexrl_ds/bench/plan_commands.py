"""The planner commands (registered in cli/planning.py): `flexrl make-workload`, `flexrl plan`,
`flexrl simulate`, `flexrl bench planner`. Each takes the parsed arguments and returns the exit code."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from flexrl_ds.bench.planner_bench import (SEQUENCE_COUNTS, WORLD_SIZES, PlannerBench, format_quality,
                                           format_timing, measure_quality, time_planner)
from flexrl_ds.bench.simulator import (default_extra_p_maxes, format_projection, format_table, plot_loads,
                                       plot_projection, project, simulate)
from flexrl_ds.bench.workloads import make_workload
from flexrl_ds.common.output_files import output_file
from flexrl_ds.config.flexrl_config import load_run_config
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.planning.plan import load_workload, validate_plan
from flexrl_ds.planning.micro_batches import plan_micro_batches
from flexrl_ds.planning.planner import (PlannerOptions, StepOverflowError, allowed_degrees, apply_oversize,
                                       plan_step)
from flexrl_ds.planning.schedule import check_schedule
from flexrl_ds.planning.step_time import LinkOverrides


def _resolve(args):
    """(SPConfig, CostModel, PlannerOptions) from --config plus flag overrides."""
    base = load_run_config(args.config).flexrl.sp if args.config else SPConfig()
    overrides = {key: getattr(args, key) for key in ("p_max", "max_tokens_per_rank", "h_pack", "H_pack", "oversize")
                 if getattr(args, key) is not None}
    if args.model:
        overrides["cost_model"] = args.model
    if args.calibration:
        overrides["calibration"] = args.calibration
    for key, value in overrides.items():
        if key != "oversize" and key not in ("cost_model", "calibration") and value <= 0:
            raise ValueError(f"--{key.replace('_', '-')}: must be positive, got {value}")
    # these tools plan under the plain cap
    sp = dataclasses.replace(base, logprob_max_tokens_per_rank=None, **overrides)
    calibration = None if sp.calibration == "none" else sp.calibration
    device_name = args.device
    if calibration == "auto" and device_name is None:
        # lazy: parallel.device imports torch, needed only to name the local GPU for the 'auto' calibration
        from flexrl_ds.parallel.device import accelerator_name

        device_name = accelerator_name()
    cost = load_cost_model(sp.cost_model or "qwen2.5-vl-7b", calibration, device_name=device_name)
    return sp, _with_links(cost, args), PlannerOptions(head_rule=args.head_rule)


def _with_links(cost, args):
    """`cost` with the --gpus-per-node / --nvlink-GBps / --network-* overrides applied to its step model."""
    giga = lambda value: None if value is None else value * 1e9  # noqa: E731
    overrides = LinkOverrides(args.gpus_per_node, giga(args.nvlink_GBps), giga(args.network_GBps),
                              None if args.network_latency_us is None else args.network_latency_us * 1e-6)
    if overrides == LinkOverrides():
        return cost
    if cost.step is None:
        raise ValueError("--gpus-per-node / --nvlink-GBps / --network-*: need a calibration with step-time fits "
                         "(--calibration FILE, or 'auto' with --device)")
    calibration = dataclasses.replace(cost.calibration, step=overrides.apply(cost.step))
    return dataclasses.replace(cost, calibration=calibration)


def make_workload_command(args) -> int:
    """`flexrl make-workload`."""
    workload = make_workload(args.mix, args.num, args.seed, args.n_samples)
    output_file(args.out).write_text(json.dumps(workload.to_json(), indent=1) + "\n")
    tokens = [s.tokens for s in workload.sequences]
    print(f"wrote {args.out}: {len(tokens)} sequences ({args.mix}, seed {args.seed}, {args.n_samples} samples/prompt), "
          f"tokens min {min(tokens)} / mean {sum(tokens) / len(tokens):.0f} / max {max(tokens)}")
    return 0


def plan(args) -> int:
    """`flexrl plan`: plan one pass as `flexrl train` does: one plan, or, where the sequences together
    overflow max_tokens_per_rank x the ranks, the fewest micro-batches that plan
    (planning/micro_batches.py); check each, print (or --json) the summaries, --out writes the plan
    (with micro-batches, one file each: `<stem>_micro<i><suffix>`)."""
    workload = load_workload(args.workload)
    sp, cost, options = _resolve(args)
    try:
        results = [plan_step(workload, args.world_size, cost, sp, options)]
    except StepOverflowError:  # the whole pass does not fit: cut it as the trainer does
        return _plan_micro_batches(args, workload, sp, cost, options)
    return _report_plans(args, results, [args.out], sp, cost, options)


def _plan_micro_batches(args, workload, sp, cost, options) -> int:
    """The pass as micro-batches, oversize sequences dropped or truncated once beforehand (so that
    the cuts see the tokens that are planned), then cut (planning/micro_batches.py)."""
    max_degree = allowed_degrees(args.world_size, sp, cost, options.head_rule)[-1]
    kept, dropped, truncated = apply_oversize(workload, sp, max_degree)
    results = [result for (result,) in plan_micro_batches([kept], args.world_size, cost,
                                                          dataclasses.replace(sp, oversize="error"), options)]
    results[0] = dataclasses.replace(results[0], dropped=dropped, truncated=truncated)  # reported once
    if not args.json:
        print(f"{len(kept.sequences)} sequences ({sum(s.tokens for s in kept.sequences)} tokens) do not plan "
              f"in one pass under max_tokens_per_rank {sp.max_tokens_per_rank} x {args.world_size} ranks: "
              f"{len(results)} micro-batches, numbered from 0, as `flexrl train` runs them (their gradients add up)")
    return _report_plans(args, results, [_micro_path(args.out, i) for i in range(len(results))], sp, cost, options)


def _report_plans(args, results, outs, sp, cost, options) -> int:
    """Check each plan, write it where asked, print (or --json) its summary."""
    summaries = []
    for index, (result, out) in enumerate(zip(results, outs)):
        validate_plan(result.plan, result.workload)
        check = check_schedule(result.plan)
        assert check.deadlock_free, check.describe()
        if out:
            result.plan.save(out)
        summaries.append(_plan_summary(result, check))
        if not args.json:
            if len(results) > 1:
                print(f"micro-batch {index} of {len(results)}:")
            _print_plan(result, check, cost, sp, options, args.world_size, out)
    if args.json:
        print(json.dumps(summaries[0] if len(summaries) == 1 else {"micro_batches": summaries}, indent=1))
    return 0


def _micro_path(out: str | None, index: int) -> str | None:
    if not out:
        return None
    path = Path(out)
    return str(path.with_name(f"{path.stem}_micro{index}{path.suffix}"))


def _plan_summary(result, check) -> dict:
    summary = result.metrics.summary()
    summary.update(degree_cap=result.plan.extra["degree_cap"], dropped=list(result.dropped),
                   truncated={k: v[1] for k, v in result.truncated.items()}, schedule=check.describe(),
                   h_pack=result.limits.h_pack, H_pack=result.limits.H_pack)
    return summary


def _print_plan(result, check, cost, sp, options, world_size: int, out: str | None) -> None:
    m = result.metrics
    hist = ", ".join(f"d={d}: {n}" for d, n in sorted(m.degree_histogram.items()))
    calibration = cost.calibration.source if cost.calibration is not None else "none (FLOP formula)"
    print(f"plan for {len(result.workload.sequences)} sequences on {world_size} ranks "
          f"(model {cost.name}, c={cost.c:.0f}, p_max {sp.p_max}, h_pack {result.limits.h_pack}, "
          f"H_pack {result.limits.H_pack}, calibration {calibration})")
    if m.step_time_s > 0:
        print(f"  projected step {m.step_time_s * 1e3:.1f} ms on the busiest rank: compute {m.compute_s * 1e3:.1f} ms, "
              f"exposed all-to-all {m.exposed_all_to_all_s * 1e3:.1f} ms; mean idle {m.idle_s * 1e3:.1f} ms")
    print(f"  attention balance {m.attention_balance:.3f}   cost balance {m.cost_balance:.3f}   "
          f"token balance {m.token_balance:.3f}   efficiency {m.efficiency:.3f}")
    print(f"  bounds for any plan on aligned groups: attention balance >= {m.attention_balance_bound:.3f}, "
          f"efficiency <= {m.efficiency_bound:.3f}")
    cap = result.plan.extra["degree_cap"]
    print(f"  degrees: {hist}   packs: {m.num_packs}   schedule: {check.describe()}")
    print(f"  largest degree {cap['max_degree']} (bound by {cap['by']}: p_max {cap['p_max']}, "
          f"world size {cap['world_size']}, {cap['num_heads']} query heads, head rule {options.head_rule})")
    print(f"  all-to-all volume {m.all_to_all_volume:.0f} tokens = {m.all_to_all_relative:.3f} x fixed SP at p_max")
    if result.dropped:
        print(f"  dropped (oversize): {', '.join(result.dropped)}")
    for seq_id, (before, after) in result.truncated.items():
        print(f"  truncated (oversize): {seq_id} {before} -> {after} tokens")
    if out:
        print(f"  wrote {out}")


def simulate_command(args) -> int:
    """`flexrl simulate`: the methods on generated steps at --world-size, or projected over --world-sizes."""
    sp, cost, options = _resolve(args)
    if (args.world_size is None) == (args.world_sizes is None):
        raise ValueError("give one of --world-size or --world-sizes")
    if args.world_sizes is not None:
        return _project(args, sp, cost, options)
    if args.world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
    extra = _extra_p_maxes(args.extra_p_max, args.world_size, sp, cost)
    progress = None if args.json else (lambda done, total: print(f"  seed {done}/{total} done", file=sys.stderr))
    sim = simulate(args.mix, args.world_size, args.gbs, args.n_samples, args.seeds, cost, sp, options, progress,
                   extra)
    if args.plot:
        plot_loads(sim, args.plot)
    if args.json:
        print(json.dumps(sim.to_json(), indent=1))
    else:
        print(format_table(sim))
        if args.plot:
            print(f"wrote {args.plot}")
    return 0


def _project(args, sp, cost, options) -> int:
    def extra(world_size, sp, cost):
        if args.extra_p_max in ("auto", "none"):
            return _extra_p_maxes(args.extra_p_max, world_size, sp, cost)
        caps = [c for c in args.extra_p_max.split(",") if c.strip().isdigit() and int(c) <= world_size]
        return _extra_p_maxes(",".join(caps), world_size, sp, cost) if caps else ()

    progress = None if args.json else (lambda size: print(f"  {size} GPUs done", file=sys.stderr))
    proj = project(args.mix, args.world_sizes, args.gbs, args.n_samples, args.seeds, cost, sp, options,
                   not args.fixed_gbs, extra, progress)
    if args.plot:
        plot_projection(proj, args.plot)
    if args.json:
        print(json.dumps(proj.to_json(), indent=1))
        return 0
    print(format_projection(proj))
    if args.plot:
        print(f"wrote {args.plot}")
    return 0


def _extra_p_maxes(text: str, world_size: int, sp, cost) -> tuple[int, ...]:
    """Parse --extra-p-max: 'auto', 'none' or a comma list of powers of two ≤ the world size."""
    if text == "auto":
        return default_extra_p_maxes(world_size, sp, cost)
    if text == "none":
        return ()
    caps = []
    for item in text.split(","):
        if not item.strip().isdigit():
            raise ValueError(f"--extra-p-max: {item!r} is not 'auto', 'none' or a positive integer")
        cap = int(item)
        if cap < 1 or cap & (cap - 1) or cap > world_size:
            raise ValueError(f"--extra-p-max: {cap} must be a power of two ≤ --world-size {world_size}")
        if cap != sp.p_max:
            caps.append(cap)
    return tuple(dict.fromkeys(caps))


def bench_planner(args) -> int:
    """`flexrl bench planner`: planning time and plan quality over the grid."""
    sp, cost, options = _resolve(args)
    out = PlannerBench()
    say = (lambda text: None) if args.json else (lambda text: print(text, file=sys.stderr, flush=True))
    grid = {"counts": args.counts or SEQUENCE_COUNTS, "world_sizes": args.world_sizes or WORLD_SIZES}
    if not args.no_timing:
        out.timing = time_planner(cost, sp, args.timing_mix, args.repeats, **grid, options=options,
                                  progress=lambda r: say(f"  timing N={r['num_sequences']} W={r['world_size']}: "
                                                         f"{r['plan_ms']:.1f} ms"))
    if not args.no_quality:
        out.quality = measure_quality(cost, sp, args.seeds, **grid, options=options, progress=lambda r: say(
            f"  quality {r['mix']} W={r['world_size']} N={r['num_sequences']}: eff {r['efficiency_min']:.3f}"))
    if args.json:
        print(json.dumps(out.to_json(), indent=1))
        return 0
    if out.timing:
        print(format_timing(out.timing))
    if out.quality:
        print(format_quality(out.quality))
    return 0
