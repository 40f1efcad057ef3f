"""FlexUlysses execution commands: `flexrl bench sp`.

Runs N ranks: under torchrun / the deepspeed launcher (RANK/WORLD_SIZE set) each process is one rank;
otherwise `--nproc N` spawns N local processes with a torchrun-style environment.
"""

from __future__ import annotations


def register(commands, bench) -> None:
    sp = bench.add_parser("sp", help="forward+backward of one decoder layer: FlexUlysses vs bucketing vs fixed SP")
    sp.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not started by torchrun (default 2)")
    sp.add_argument("--shape", default="7b", help="layer width: 7b (Qwen2.5-VL-7B LLM) | tiny (CPU smoke run)")
    sp.add_argument("--layer", choices=("decoder", "attention"), default="decoder",
                    help="full decoder layer or attention part only")
    sp.add_argument("--long", default="49152", help="long sequence lengths, comma-separated (default 49152)")
    sp.add_argument("--num-short", type=int, default=24, help="short sequences (default 24)")
    sp.add_argument("--short-range", default="600,3000", help="short sequence length range MIN,MAX")
    sp.add_argument("--workload", help="workload JSON (docs/PLAN_SCHEMA.md) instead of the generated batch")
    sp.add_argument("--p-max", type=int, default=8, help="largest FlexUlysses degree (clamped to the world)")
    sp.add_argument("--fixed-degree", type=int, default=2, help="degree of the fixed-SP baseline")
    sp.add_argument("--systems", default="flex,bucketing,fixed", help="comma-separated subset")
    sp.add_argument("--dtype", default=None, help="bfloat16 on GPU, float32 on CPU by default")
    sp.add_argument("--warmup", type=int, default=2)
    sp.add_argument("--iters", type=int, default=5)
    sp.add_argument("--no-overlap", action="store_true", help="FlexUlysses without all-to-all prefetch")
    sp.add_argument("--calibrate", metavar="OUT.json",
                    help="measure attention / linear / all-to-all constants and write the cost-model "
                         "calibration file (flexrl.sp.calibration) instead of comparing systems")
    sp.add_argument("--json", help="write the result record here")
    sp.add_argument("--plot", help="write a PNG bar chart here")
    sp.set_defaults(func=_bench_sp)


def _bench_sp(args) -> int:
    from flexrl_ds.bench import sp_command  # lazy: imports torch (`flexrl --help` stays fast)

    return sp_command.bench_sp(args)
