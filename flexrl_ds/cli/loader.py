"""`flexrl bench loader`: centralised loading vs ShadowLoader (exposed data time, controller memory
and bytes, throughput) on a dataset with real media."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from flexrl_ds.bench.ablation import ablation_report, format_report
from flexrl_ds.bench.loader_bench_config import DEFAULT_CPUS_PER_ACTOR, MODES, LoaderBenchConfig
from flexrl_ds.bench.loader_report import format_table, summary
from flexrl_ds.common.output_files import output_file


def register(commands, bench) -> None:
    loader = bench.add_parser(
        "loader", help="centralised vs ShadowLoader: exposed data time, controller RSS and bytes, samples/s",
        description="Runs the centralised (controller decodes and ships tensors) and the ShadowLoader "
                    "(metadata-only controller, Ray preprocessing actors, prefetching workers) paths "
                    "on the same steps, one controller process per run, and prints a table. Several "
                    "values of --global-batch / --actors may be given.",
    )
    loader.add_argument("--data", required=True, help="dataset file, e.g. from `flexrl make-dataset --mix video-heavy`")
    loader.add_argument("--global-batch", type=int, nargs="+", required=True, help="prompts per step (B)")
    loader.add_argument("--steps", type=int, required=True, help="measured steps per run")
    loader.add_argument("--actors", type=int, nargs="+", required=True, help="preprocessing actors (K)")
    loader.add_argument("--compute-ms", type=float, default=0.0, help="simulated compute per step (ms)")
    loader.add_argument("--workers", type=int, default=2, help="worker actors standing in for ranks")
    loader.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="which loading paths to run (default: all; the ratios need central and shadow)")
    loader.add_argument("--config", help="DeepSpeed JSON whose flexrl.data section sets the loader, pool, "
                                         "bad-record policy and pixel settings (default: their defaults); "
                                         "the options here override it")
    loader.add_argument("--n-samples", type=int, default=None,
                        help="GRPO samples per prompt (default: flexrl.data.loader.num_samples_per_prompt, 1)")
    loader.add_argument("--warmup-steps", type=int, default=1)
    loader.add_argument("--cpus-per-actor", type=float, default=None,
                        help="Ray CPUs per preprocessing actor (default: flexrl.data.pool.num_cpus_per_actor "
                             f"with --config, else {DEFAULT_CPUS_PER_ACTOR})")
    loader.add_argument("--model", help="saved HF processor folder setting the vision geometry")
    loader.add_argument("--seed", type=int, default=None,
                        help="sample order seed (default: flexrl.data.loader.seed, 0)")
    loader.add_argument("--json", action="store_true", help="print results as JSON instead of a table")
    loader.add_argument("--plot", help="write a PNG: exposed data time and controller RSS per run")
    loader.set_defaults(func=_bench_loader)

    ablation = bench.add_parser(
        "ablation-report", help="the data-loading ablation's table from two `flexrl train` runs (central, shadow)",
        description="Reads RUN_A/metrics.jsonl and RUN_B/metrics.jsonl (two `flexrl train` runs of the same "
                    "prompts, seeds and responses, e.g. flexrl.data.loading central and shadow) and prints, "
                    "averaged over the steps after the first, each phase's seconds, the exposed data time "
                    "and its share of the step, the bytes through the loader's controller, the "
                    "controller's and the driver's peak RSS and tokens/GPU/s, side by side; and whether "
                    "both trained on the same samples (rollouts/step_N.jsonl).",
    )
    ablation.add_argument("runs", nargs=2, metavar="RUN", help="`flexrl train` --out folders (A, then B)")
    ablation.add_argument("--all-steps", action="store_true", help="average every step, step 0 included")
    ablation.add_argument("--json", help="also write the figures as JSON here")
    ablation.add_argument("--out", help="also write the Markdown table here")
    ablation.set_defaults(func=_bench_ablation_report)


def _bench_loader(args: argparse.Namespace) -> int:
    from flexrl_ds.bench import loader_bench  # lazy: imports Ray and torch (`flexrl --help` stays fast)

    config = LoaderBenchConfig(
        data=args.data, global_batches=args.global_batch, steps=args.steps, actors=args.actors,
        compute_ms=args.compute_ms, num_workers=args.workers, num_samples_per_prompt=args.n_samples,
        warmup_steps=args.warmup_steps, num_cpus_per_actor=args.cpus_per_actor, seed=args.seed,
        model_dir=args.model, modes=args.modes, run_config=args.config,
    )
    results = loader_bench.run_bench(config)
    if args.plot:
        _plot(results, args.plot)
    if args.json:
        print(json.dumps({"config": asdict(config), "flexrl_data": asdict(config.data_config()),
                          "runs": [asdict(r) for r in results],
                          "summary": summary(results)}, indent=1))
    else:
        print(format_table(results))
        for batch, ratios in summary(results).items():
            exposed = ratios["exposed_ratio"]
            print(f"B={batch}: shadow/central exposed data time "
                  f"{'n/a' if exposed is None else f'{100 * exposed:.2f}%'}, "
                  f"controller bytes {100 * ratios['controller_bytes_ratio']:.3f}%, controller RSS growth "
                  f"central {ratios['controller_rss_growth_mb']['central']:.0f} MB vs shadow "
                  f"{ratios['controller_rss_growth_mb']['shadow']:.0f} MB", file=sys.stdout)
    return 0


def _bench_ablation_report(args: argparse.Namespace) -> int:
    report = ablation_report(args.runs[0], args.runs[1], all_steps=args.all_steps)
    text = format_report(report)
    print(text)
    if args.out:
        output_file(args.out).write_text(text + "\n")
    if args.json:
        output_file(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _plot(results, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r.mode}\nB={r.global_batch}" + (f" K={r.actors}" if r.actors else "") for r in results]
    colors = ["tab:red" if r.mode == "central" else "tab:blue" for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(results)), 4))
    left.bar(labels, [r.exposed_ms for r in results], color=colors)
    left.set_ylabel("exposed data time per step (ms)")
    right.bar(labels, [r.controller_rss_peak_mb - r.controller_rss_start_mb for r in results], color=colors)
    right.set_ylabel("controller RSS growth during run (MB)")
    for axis in (left, right):
        axis.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"flexrl bench loader (compute {results[0].compute_ms:.0f} ms/step)")
    fig.tight_layout()
    fig.savefig(output_file(path), dpi=120)
    print(f"wrote {path}", file=sys.stderr)
