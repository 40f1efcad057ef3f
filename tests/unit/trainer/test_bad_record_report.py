"""The trainer says what each step's bad records did (driver.report_bad_records, fed the loader's
`LoaderStep.report()`; the fates themselves: tests/unit/data/test_bad_records.py, and through the
training loader tests/ray/test_loader_policy.py), and stops with their reasons when none of the
step's records was usable."""

from __future__ import annotations

import pytest

from flexrl_ds.common import RunInputError
from flexrl_ds.media.bad_records import FATE_BAD_SUBSTITUTE, FATE_SKIPPED, fate_replaced
from flexrl_ds.trainer.driver import report_bad_records


def loader_report(bad: list[tuple[str, str, str]], replacements: dict[str, str] | None = None) -> dict:
    """`LoaderStep.report()` of a step with these (id, reason, fate) bad records."""
    return {"bad_records": [{"id": record_id, "reason": reason, "stage": "probe", "fate": fate}
                            for record_id, reason, fate in bad],
            "replacements": replacements or {}, "withdrawn": {}}


def test_each_bad_record_is_named_with_its_reason_and_fate(capsys):
    report = loader_report([("img-1", "image 0 (a.png): missing file", FATE_SKIPPED),
                            ("img-3", "prompt: not a string", fate_replaced("img-7")),
                            ("img-9", "video 0 (v.mp4): missing file", FATE_BAD_SUBSTITUTE)],
                           replacements={"img-3": "img-7"})
    assert report_bad_records(4, report, trained_on=3) == 3
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert "step 4" in lines[0] and "'img-1'" in lines[0] and "missing file" in lines[0] and FATE_SKIPPED in lines[0]
    assert "'img-3'" in lines[1] and "not a string" in lines[1] and "'img-7' stands in" in lines[1]
    assert "'img-9'" in lines[2] and FATE_BAD_SUBSTITUTE in lines[2]


def test_a_clean_step_says_nothing(capsys):
    assert report_bad_records(0, loader_report([]), trained_on=2) == 0
    assert capsys.readouterr().out == ""


def test_a_step_without_any_usable_record_stops_with_the_reasons():
    bad = [(f"vid-{index}", f"video 0 (v{index}.mp4): missing file", FATE_SKIPPED) for index in range(7)]
    with pytest.raises(RunInputError, match=r"step 2: every record drawn for it was bad \('vid-0': video 0 "
                                           r"\(v0.mp4\): missing file; .*'vid-4'.* \.\.\.\).*inspect-data") as caught:
        report_bad_records(2, loader_report(bad), trained_on=0)
    assert "vid-5" not in str(caught.value)  # the first five, then "..."
