"""`flexrl bench sp` (registered in cli/sp_exec.py): the options turned into an `SPBenchConfig`, the
ranks run under a launcher or spawned here, and the report (bench/sp_bench.py runs each rank)."""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch.multiprocessing as mp

from flexrl_ds.bench.sp_bench import SHAPES, SPBenchConfig, dumps, format_table, run_rank, write_plot
from flexrl_ds.common.output_files import output_file
from flexrl_ds.parallel import device


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"{option}: lengths must be positive, got {text!r}")
    return values


def _config(args):
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


def bench_sp(args) -> int:
    """`flexrl bench sp`: run here under a launcher (RANK/WORLD_SIZE set), else spawn `--nproc` ranks."""
    config = _config(args)
    for path in (args.json, args.calibrate):
        if path:
            output_file(path)  # a folder in the way is named now, not after the benchmark
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
        output_file(args.calibrate).write_text(dumps(calibration) + "\n")
        c = calibration["linear_s_per_token"] / calibration["attention_s_per_token2"]
        print(f"[bench sp] attention {calibration['attention_s_per_token2']:.3g} s/L^2, linear "
              f"{calibration['linear_s_per_token']:.3g} s/token (c = {c:,.0f}); all-to-all "
              + ", ".join(f"d={d}: {v['latency_s'] * 1e6:.0f} us + {v['bytes_per_s'] / 1e9:.0f} GB/s"
                          for d, v in calibration["all_to_all"].items()))
        print(f"[bench sp] wrote {args.calibrate}")
        return
    print(format_table(record))
    if args.json:
        output_file(args.json).write_text(dumps(record) + "\n")
        print(f"[bench sp] wrote {args.json}")
    if args.plot:
        write_plot(record, args.plot)
        print(f"[bench sp] wrote {args.plot}")


def _rank_main(rank: int, world_size: int, port: int, config, out_path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    record = run_rank(config)
    if record is not None:
        output_file(out_path).write_text(dumps(record))


def _spawn(config, nproc: int):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out_path = str(Path(tmp) / "record.json")
        print(f"[bench sp] spawning {nproc} ranks", file=sys.stderr, flush=True)
        mp.start_processes(_rank_main, args=(nproc, port, config, out_path), nprocs=nproc, join=True,
                           start_method="spawn")
        return json.loads(Path(out_path).read_text())
