"""`flexrl bench faults`: what a run survives, case by case, in figures.

Each case injects one fault into a small piece of a real run on CPU (the tiny model, a dataset of real
media built in a temporary folder) and checks the behaviour the project promises for it: one row
per case with what was injected, what is expected, what was observed, the samples lost and
duplicated, the seconds until the fault was detected and until the run was back (None where that
does not apply) and whether the case passed. The cases live in bench/fault_data.py (bad inputs, the
dataset root, pickle), bench/fault_steps.py (rewards, checkpoints, services) and
bench/fault_train.py (whole `flexrl train` runs: the driver killed, a policy rank killed or stalled,
a preprocessing actor or a rollout engine killed, the sockets a run listens on) and bench/fault_spmd.py
(a rank of a `deepspeed --hostfile` run killed); those marked `slow` run only with `--slow` (or
`--only`): they start Ray and train, minutes on a small CPU machine.

A case is a function of a scratch folder returning `Observed`; a case that raises fails with the
exception as what was observed (the suite never stops at one case).
"""

from __future__ import annotations

import json
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Observed:
    """What one case saw."""

    observed: str
    """What happened, in a line."""
    passed: bool
    lost: int = 0
    """Samples (dataset records, scored responses) that went missing without being reported."""
    duplicated: int = 0
    """Samples that were trained on, scored or drawn more than once."""
    detect_s: float | None = None
    """Seconds from the fault to its detection (a clear error, a reported record); None: not timed."""
    recover_s: float | None = None
    """Seconds from the detection until the run went on (a resume's first step done); None: n/a."""


@dataclass(frozen=True)
class Case:
    """One fault and the behaviour expected of it."""

    name: str
    injected: str
    expected: str
    run: Callable[[Path], Observed]
    slow: bool = False


@dataclass
class CaseRow:
    """A row of the suite's table (`--json`: one object of "cases")."""

    case: str
    injected: str
    expected: str
    observed: str
    passed: bool
    lost: int
    duplicated: int
    detect_s: float | None
    recover_s: float | None
    slow: bool
    wall_s: float


def all_cases() -> list[Case]:
    """Every case of the suite, fast ones first."""
    # lazy: the case modules import torch, DeepSpeed and Ray; `flexrl --help` imports only the CLI
    from flexrl_ds.bench import fault_data, fault_spmd, fault_steps, fault_train

    return fault_data.CASES + fault_steps.CASES + fault_train.CASES + fault_spmd.CASES


def select_cases(cases: list[Case], only: list[str] | None, slow: bool) -> list[Case]:
    """`only` (names; a name ending in ':' or '*' picks every case it starts) or, without it, the
    fast cases and with `slow` the slow ones too. ValueError naming an unknown case."""
    if not only:
        return [case for case in cases if slow or not case.slow]
    chosen = []
    for name in only:
        prefix = name.rstrip("*")
        matched = [case for case in cases if case.name == name or (prefix != name and case.name.startswith(prefix))]
        if not matched:
            raise ValueError(f"--only {name}: no such case; cases: {', '.join(case.name for case in cases)}")
        chosen += [case for case in matched if case not in chosen]
    return chosen


def run_case(case: Case, scratch: Path) -> CaseRow:
    started = time.perf_counter()
    folder = scratch / case.name.replace(":", "_")
    folder.mkdir(parents=True, exist_ok=True)
    try:
        seen = case.run(folder)
    except Exception as error:  # a case that breaks is a failed row, never the end of the suite
        last = traceback.extract_tb(error.__traceback__)[-1]
        seen = Observed(f"the case raised {type(error).__name__}: {error} ({Path(last.filename).name}:{last.lineno})",
                        passed=False)
    return CaseRow(case.name, case.injected, case.expected, seen.observed, bool(seen.passed), seen.lost,
                   seen.duplicated, _rounded(seen.detect_s), _rounded(seen.recover_s), case.slow,
                   round(time.perf_counter() - started, 2))


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 3)


def run_suite(cases: list[Case], scratch: Path | None = None, progress: Callable[[CaseRow], None] | None = None
              ) -> list[CaseRow]:
    """Run `cases` in order, each in a folder of its own under `scratch` (a temporary one if None)."""
    with tempfile.TemporaryDirectory(prefix="flexrl-faults-") as temporary:
        root = Path(scratch) if scratch is not None else Path(temporary)
        rows = []
        for case in cases:
            rows.append(run_case(case, root))
            if progress is not None:
                progress(rows[-1])
        return rows


def format_row(row: CaseRow) -> str:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    return (f"{'PASS' if row.passed else 'FAIL'}  {row.case:32} lost {row.lost:<3} dup {row.duplicated:<3} "
            f"detect {seconds(row.detect_s):>6} s  recover {seconds(row.recover_s):>6} s\n"
            f"      injected: {row.injected}\n      expected: {row.expected}\n      observed: {row.observed}")


def summary(rows: list[CaseRow], not_run: list[str]) -> str:
    failed = [row.case for row in rows if not row.passed]
    line = (f"{len(rows) - len(failed)}/{len(rows)} cases passed, {sum(row.lost for row in rows)} samples lost, "
            f"{sum(row.duplicated for row in rows)} duplicated" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if not_run:
        line += f"\n{len(not_run)} slow cases not run ({', '.join(not_run)}): flexrl bench faults --slow"
    return line


def as_json(rows: list[CaseRow], not_run: list[str]) -> str:
    return json.dumps({"cases": [asdict(row) for row in rows], "not_run": not_run,
                       "passed": all(row.passed for row in rows)}, indent=1)
