"""`flexrl bench faults --json` on the fast cases: every case listed, all passed, nothing lost or
duplicated (the CI gate of the fault suite; the slow cases: `flexrl bench faults --slow`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flexrl_ds.bench import fault_data, fault_steps
from flexrl_ds.bench.faults import all_cases, select_cases


def test_the_fast_cases_all_pass_with_nothing_lost_or_duplicated(tmp_path):
    done = subprocess.run([sys.executable, "-m", "flexrl_ds", "bench", "faults", "--json", "--scratch", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    report = json.loads(done.stdout)
    names = [row["case"] for row in report["cases"]]
    assert names == [case.name for case in fault_data.CASES + fault_steps.CASES]
    failed = {row["case"]: row["observed"] for row in report["cases"] if not row["passed"]}
    assert not failed and done.returncode == 0 and report["passed"]
    assert sum(row["lost"] for row in report["cases"]) == 0
    assert sum(row["duplicated"] for row in report["cases"]) == 0
    assert len([name for name in names if name.startswith("bad_input:")]) >= 12
    assert {"detect_s", "recover_s", "injected", "expected"} <= set(report["cases"][0])
    assert set(report["not_run"]) == {case.name for case in all_cases() if case.slow}


def test_only_picks_cases_by_name_and_prefix():
    cases = all_cases()
    assert [case.name for case in select_cases(cases, ["reward:*"], slow=False)] == \
        [case.name for case in cases if case.name.startswith("reward:")]
    with pytest.raises(ValueError, match="--only nothing: no such case"):
        select_cases(cases, ["nothing"], slow=False)


def test_the_unpickling_audit_finds_every_kind_of_call(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "reader.py").write_text(
        "import pickle, torch, numpy as np\n"
        "pickle.loads(b'')\n"
        "torch.load('x')\n"
        "torch.load('x', weights_only=True)\n"
        "np.load('x')\n"
        "np.load('x', allow_pickle=True)\n")
    assert [(line, call) for _, line, call in fault_steps.pickle_reads(package)] == \
        [(2, "pickle.loads"), (3, "torch.load"), (6, "np.load")]
