"""`flexrl bench faults`: the fault and bad-input suite (flexrl_ds/bench/faults.py)."""

from __future__ import annotations

import sys


def register(commands, bench) -> None:
    faults = bench.add_parser(
        "faults", help="what a run survives: bad inputs, reward, checkpoint, worker and driver faults, security",
        description="Injects one fault per case into a small piece of a real run on CPU (the tiny model, a "
                    "dataset of real media built in a temporary folder) and prints one row per case: what was "
                    "injected, the behaviour expected, the behaviour observed, samples lost and duplicated, "
                    "seconds to detect and to recover, pass or fail. Without --slow only the fast cases run "
                    "(seconds; what CI runs); --slow adds those that start Ray and train (minutes). Exit code "
                    "1 if a case failed.",
    )
    faults.add_argument("--json", action="store_true", help='print {"cases": [...], "not_run": [...], "passed": ...}')
    faults.add_argument("--only", nargs="+", metavar="CASE",
                        help="run only these cases (a name ending in '*' picks every case it starts, e.g. 'reward:*')")
    faults.add_argument("--slow", action="store_true", help="also run the slow cases (Ray, whole training runs)")
    faults.add_argument("--list", action="store_true", help="list the cases and exit")
    faults.add_argument("--scratch", help="keep the cases' folders here (default: a temporary folder, removed)")
    faults.set_defaults(func=_faults)


def _faults(args) -> int:
    # lazy: the cases import torch, DeepSpeed and Ray (`flexrl --help` stays fast)
    from flexrl_ds.bench import faults

    cases = faults.all_cases()
    if args.list:
        for case in cases:
            print(f"{case.name:34} {'slow' if case.slow else 'fast'}  {case.injected}")
        return 0
    chosen = faults.select_cases(cases, args.only, args.slow)
    not_run = [case.name for case in cases if case not in chosen and case.slow and not args.only]

    def progress(row) -> None:
        print(faults.format_row(row), file=sys.stderr if args.json else sys.stdout, flush=True)

    rows = faults.run_suite(chosen, args.scratch, progress)
    if args.json:
        print(faults.as_json(rows, not_run))
    else:
        print(faults.summary(rows, not_run))
    return 0 if all(row.passed for row in rows) else 1
