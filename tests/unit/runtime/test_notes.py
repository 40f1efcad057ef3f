"""common/notes.py: said lines are printed here, and kept for a driver only once `keep` was called."""

from __future__ import annotations

import pytest

from flexrl_ds.common import notes


@pytest.fixture
def fresh_notes(monkeypatch):
    monkeypatch.setattr(notes, "_kept", None)


def test_a_line_is_printed_and_kept_only_after_keep(fresh_notes, capsys):
    notes.say("before keep")
    assert notes.take() == []  # nothing keeps lines outside a Ray actor
    notes.keep()
    notes.say("first")
    notes.say("second")
    assert capsys.readouterr().out.splitlines() == ["before keep", "first", "second"]
    assert notes.take() == ["first", "second"]
    assert notes.take() == []  # taken once
    notes.keep()  # a second keep loses nothing
    notes.say("third")
    notes.keep()
    assert notes.take() == ["third"]
