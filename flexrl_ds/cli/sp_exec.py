"""FlexUlysses execution commands: `flexrl bench sp`.

Runs N ranks: under torchrun / the deepspeed launcher (RANK/WORLD_SIZE set) each process is one rank;
otherwise `--nproc N` spawns N local processes with a torchrun-style environment.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path

from flexrl_ds.bench.sp_bench import SHAPES, SPBenchConfig, dumps, format_table, run_rank, write_plot

# parallel.device and torch.multiprocessing import torch: imported where used, so that `flexrl --help`
# (which imports this module to register the command) stays fast.


def register(commands, bench) -> None:
    sp = bench.add_parser("sp", help="forward+backward of one decoder layer: FlexUlysses vs bucketing vs fixed SP")
    sp.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not started by torchrun (default 2)")
    sp.add_argument("--shape", default="7b", help="layer width: 7b (Qwen2.5-VL-7B LLM) | tiny (CPU smoke run)")
    sp.add_argument("--layer", choices=("decoder", "attention"), default="decoder",
                    help="full decoder layer or attention part only")
    sp.add_argument("--long", default="49152", help="long sequence lengths, comma-separated (default 49152)")
    sp.add_argument("--num-short", type=int, default=24, help="short sequences (default 24)")
    sp.add_argument("--short-range", default="600,3000", help="short sequence length range MIN,MAX")
    sp.add_argument("--workload", help="workload JSON (plan-schema.md) instead of the generated batch")
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


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{option}: lengths must be positive, got {text!r}")
    return values


def _config(args):
    from flexrl_ds.parallel import device

    if args.shape not in SHAPES:
        raise ValueError(f"--shape {args.shape!r}: one of {', '.join(SHAPES)}")
    short = _ints(args.short_range, "--short-range")
    if len(short) != 2 or short[0] > short[1]:
        raise ValueError(f"--short-range: expected MIN,MAX, got {args.short_range!r}")
    dtype = args.dtype or ("bfloat16" if device.detect().is_gpu else "float32")
    return SPBenchConfig(shape=args.shape, layer=args.layer, long_tokens=_ints(args.long, "--long"),
                         num_short=args.num_short, short_min=short[0], short_max=short[1],
                         workload=args.workload, p_max=args.p_max, fixed_degree=args.fixed_degree,
                         systems=tuple(s.strip() for s in args.systems.split(",") if s.strip()),
                         dtype=dtype, warmup=args.warmup, iters=args.iters, overlap=not args.no_overlap,
                         calibrate=bool(args.calibrate))


def _bench_sp(args) -> int:
    config = _config(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        record = run_rank(config)
    else:
        if args.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
        record = _spawn(config, args.nproc)
    if record is not None:
        _report(record, args)
    return 0


def _report(record, args) -> None:
    if "calibration" in record:
        calibration = record["calibration"]
        Path(args.calibrate).write_text(dumps(calibration) + "\n")
        c = calibration["linear_s_per_token"] / calibration["attention_s_per_token2"]
        print(f"[bench sp] attention {calibration['attention_s_per_token2']:.3g} s/L^2, linear "
              f"{calibration['linear_s_per_token']:.3g} s/token (c = {c:,.0f}); all-to-all "
              + ", ".join(f"d={d}: {v['latency_s'] * 1e6:.0f} us + {v['bytes_per_s'] / 1e9:.0f} GB/s"
                          for d, v in calibration["all_to_all"].items()))
        print(f"[bench sp] wrote {args.calibrate}")
        return
    print(format_table(record))
    if args.json:
        Path(args.json).write_text(dumps(record) + "\n")
        print(f"[bench sp] wrote {args.json}")
    if args.plot:
        write_plot(record, args.plot)
        print(f"[bench sp] wrote {args.plot}")


def _rank_main(rank: int, world_size: int, port: int, config, out_path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    record = run_rank(config)
    if record is not None:
        Path(out_path).write_text(dumps(record))


def _spawn(config, nproc: int):
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = str(Path(tmp) / "record.json")
        print(f"[bench sp] spawning {nproc} ranks", file=sys.stderr, flush=True)
        mp.start_processes(_rank_main, args=(nproc, port, config, out_path), nprocs=nproc, join=True,
                           start_method="spawn")
        return json.loads(Path(out_path).read_text())
