"""`flexrl make-dataset` and `flexrl inspect-data` (ShadowLoader data layer)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

from flexrl_ds.config.flexrl_config import load_run_config
from flexrl_ds.loader.config import DataConfig
from flexrl_ds.media.config import VIDEO_BACKENDS

# The dataset maker, inspect-data and the probe bench import torch: each handler imports its module
# itself, so that `flexrl --help` (which imports this module to register the commands) stays fast.


def register(commands, bench) -> None:
    make = commands.add_parser(
        "make-dataset", help="generate a dataset with real media (PNG/JPEG, H.264 MP4) and train.jsonl",
        description="Generate records following the image / short_video / long_video workload "
                    "profiles (scaled down) with real media files, and DIR/train.jsonl.",
    )
    make.add_argument("--mix", required=True, choices=["image-heavy", "video-heavy", "only-video", "only-image"])
    make.add_argument("--num", type=int, required=True, help="number of records")
    make.add_argument("--scale", default="small", choices=["small", "medium", "nextqa"],
                      help="media sizes (default small); nextqa: NExTQA-like clips of 20-60 s at 360p-720p, 30 fps "
                           "(the data-loading ablation's)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--out", required=True, help="output folder")
    make.add_argument("--parquet", action="store_true", help="also write DIR/train.parquet")
    make.add_argument("--task", default="qa", choices=("qa", "keyword"),
                      help="qa: numbers / choice letters as answers; keyword: answer with a given word "
                           "(reward 'keyword'; learnable by a tiny random model)")
    make.add_argument("--workers", type=int, default=None,
                      help="processes encoding the videos (default: one per CPU where the videos are large, "
                           "as at --scale nextqa, else one)")
    make.set_defaults(func=_make_dataset)

    inspect = commands.add_parser(
        "inspect-data", help="predicted (and with --materialize actual) vision shapes per record",
        description="Probe every record's media (metadata only) and print the predicted vision "
                    "tokens and tensor shapes; --materialize also decodes and compares. Bad records "
                    "are listed with their reasons. Exit code 1 if any prediction mismatches.",
    )
    inspect.add_argument("--data", required=True, help="dataset file (.jsonl or .parquet)")
    inspect.add_argument("--model", help="model folder whose preprocessor_config.json sets the geometry")
    inspect.add_argument("--config", help="DeepSpeed JSON whose flexrl.data section configures the loader")
    inspect.add_argument("--materialize", action="store_true", help="decode and compare actual shapes")
    inspect.add_argument("--json", action="store_true", help="one JSON object per record on stdout")
    inspect.add_argument("--backend", choices=VIDEO_BACKENDS, help="video backend")
    inspect.add_argument("--media-root", help="folder under which absolute media paths are allowed")
    inspect.add_argument("--plot", help="write a PNG histogram of vision tokens per record here")
    inspect.set_defaults(func=_inspect_data)

    probe = bench.add_parser(
        "probe", help="controller-side probing vs decoding cost per record",
        description="Time metadata probing (what the controller does) against materialisation "
                    "(what the preprocessing actors do) on one dataset, and compare bytes.",
    )
    probe.add_argument("--data", required=True, help="dataset file (.jsonl or .parquet)")
    probe.add_argument("--model", help="model folder whose preprocessor_config.json sets the geometry")
    probe.add_argument("--config", help="DeepSpeed JSON whose flexrl.data section configures the loader")
    probe.add_argument("--backend", choices=VIDEO_BACKENDS, help="video backend")
    probe.add_argument("--media-root", help="folder under which absolute media paths are allowed")
    probe.add_argument("--json", action="store_true", help="print the result as JSON")
    probe.set_defaults(func=_bench_probe)


def _progress(label: str):
    """A progress callback: on a terminal every call, else every 50th, the last, and any call
    at least 5 s after the previous line."""
    interactive = sys.stderr.isatty()
    start = last = time.monotonic()

    def report(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if interactive or done == total or done % 50 == 0 or now - last >= 5.0:
            last = now
            end = "\n" if done == total else ("\r" if interactive else "\n")
            print(f"{label}: {done}/{total} ({now - start:.1f} s)", end=end, file=sys.stderr, flush=True)

    return report


def _make_dataset(args: argparse.Namespace) -> int:
    from flexrl_ds.bench.datasets import make_dataset  # lazy: imports torch (`flexrl --help` stays fast)

    start = time.monotonic()
    summary = make_dataset(args.out, args.mix, args.num, args.scale, args.seed, parquet=args.parquet,
                           progress=_progress("make-dataset"), task=args.task, workers=args.workers)
    print(f"wrote {summary.path}: {summary.num_records} records, {summary.num_images} images, "
          f"{summary.num_videos} videos, {summary.bytes_on_disk / 1e6:.2f} MB in "
          f"{time.monotonic() - start:.1f} s")
    return 0


def _data_config(args: argparse.Namespace) -> DataConfig:
    config = DataConfig()
    if args.config:
        config = load_run_config(args.config).flexrl.data
    if args.model:
        config = config.with_processor_dir(args.model)
    if args.backend:
        config = replace(config, video_backend=args.backend)
    if args.media_root:
        config = replace(config, media_root=args.media_root)
    return config


def _inspect_data(args: argparse.Namespace) -> int:
    from flexrl_ds.tools import inspect_data  # lazy: imports torch (`flexrl --help` stays fast)

    return inspect_data.inspect_data(args.data, _data_config(args), args.materialize, args.json, args.plot,
                                     progress=None if args.json else _progress("probe"))


def _bench_probe(args: argparse.Namespace) -> int:
    from flexrl_ds.bench import data_probe  # lazy: imports torch (`flexrl --help` stays fast)

    result = data_probe.bench_probe_config(args.data, _data_config(args))
    print(json.dumps(result.to_json()) if args.json else result.table())
    return 0
