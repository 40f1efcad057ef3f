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
    notes.say("only here", console=False)
    assert capsys.readouterr().out == "only here\n" and notes.take() == []
    notes.keep()  # a second keep loses nothing
    notes.say("third")
    notes.keep()
    assert notes.take() == ["third"]


def test_printing_no_actors_starts_no_ray():
    ray = pytest.importorskip("ray")
    from flexrl_ds.runtime.worker_group import print_worker_notes

    if ray.is_initialized():
        pytest.skip("a Ray session of this process is up")
    print_worker_notes([])
    assert not ray.is_initialized()


def test_printing_notes_never_hides_the_calls_error():
    """It runs in `finally` blocks: an actor whose call cannot even be sent is skipped."""
    from types import SimpleNamespace

    from flexrl_ds.runtime.worker_group import print_worker_notes

    def refuse():
        raise RuntimeError("Ray is gone")

    print_worker_notes([SimpleNamespace(take_notes=SimpleNamespace(remote=refuse))])  # returns quietly
