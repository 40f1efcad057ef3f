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


def test_an_actor_body_keeps_lines_from_construction_and_passes_its_arguments_on(fresh_notes):
    class Host:
        def __init__(self, name, size=1):
            notes.say(f"{name} built, size {size}")

    class Body(notes.NoteKeeper, Host):
        pass

    body = Body("engine", size=2)
    assert body.take_notes() == ["engine built, size 2"]  # said in the base's constructor, kept
    assert body.take_notes() == []


def test_printing_no_actors_starts_no_ray():
    """In a fresh interpreter (the test session may hold a Ray of its own): ray.wait would start one."""
    import subprocess
    import sys

    pytest.importorskip("ray")
    check = ("import ray\nfrom flexrl_ds.runtime.worker_group import print_worker_notes\n"
             "print_worker_notes([])\nprint(ray.is_initialized())")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"


def test_printing_notes_never_hides_the_calls_error():
    """It runs in `finally` blocks: an actor whose call cannot even be sent is skipped."""
    from types import SimpleNamespace

    from flexrl_ds.runtime.worker_group import print_worker_notes

    def refuse():
        raise RuntimeError("Ray is gone")

    print_worker_notes([SimpleNamespace(take_notes=SimpleNamespace(remote=refuse))])  # returns quietly
