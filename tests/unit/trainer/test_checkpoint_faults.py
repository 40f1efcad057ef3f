"""Checkpoints under faults: written to a temporary name and renamed, a truncated newest one passed
over by --resume (and said), a full disk during a save (OSError ENOSPC injected) one clear error with
the previous checkpoint intact."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from flexrl_ds.trainer.checkpoint import (STATE_FILE, CheckpointNotWritten, checkpoint_problem, is_disk_full,
                                          latest_checkpoint, read_trainer_state, resume_checkpoint, write_checkpoint,
                                          write_trainer_state)


def _rank_files(folder: Path, step: int) -> None:
    """What DeepSpeed's save writes, in miniature: a tag folder with per-rank files."""
    (folder / "policy").mkdir()
    for rank in range(2):
        (folder / "policy" / f"zero_pp_rank_{rank}_model_states.pt").write_bytes(bytes([step]) * (100 + rank))
    (folder / "latest").write_text("policy")


def _save(out: Path, step: int) -> Path:
    final = out / "checkpoints" / f"step_{step}"
    write_checkpoint(final, lambda partial: _rank_files(partial, step),
                     lambda partial: write_trainer_state(partial, step, step + 1, {"seed": 0}))
    return final


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def test_a_checkpoint_appears_under_its_name_only_when_complete(tmp_path):
    seen_during_write = []

    def write(partial: Path) -> None:
        _rank_files(partial, 4)
        seen_during_write.append((partial.name, (tmp_path / "checkpoints" / "step_4").exists()))

    final = tmp_path / "checkpoints" / "step_4"
    write_checkpoint(final, write, lambda partial: write_trainer_state(partial, 4, 5, {}))
    assert seen_during_write == [("step_4.partial", False)]
    assert sorted(path.name for path in final.parent.iterdir()) == ["step_4"]
    state = read_trainer_state(final)
    assert state["files"] == {name: len(data) for name, data in _snapshot(final).items() if name != STATE_FILE}
    assert checkpoint_problem(final) is None and latest_checkpoint(tmp_path) == final


def test_a_crash_during_a_save_leaves_no_checkpoint_a_resume_would_read(tmp_path):
    _save(tmp_path, 1)

    def crash(partial: Path) -> None:
        _rank_files(partial, 3)
        raise KeyboardInterrupt  # the driver stopped mid-save

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path / "checkpoints" / "step_3", crash, lambda partial: None)
    assert resume_checkpoint(tmp_path) == (tmp_path / "checkpoints" / "step_1", [])


@pytest.mark.parametrize("damage,reason", [
    (lambda folder: (folder / STATE_FILE).unlink(), "no trainer_state.json"),
    (lambda folder: (folder / "policy" / "zero_pp_rank_1_model_states.pt").write_bytes(b"x"), "truncated"),
    (lambda folder: (folder / "policy" / "zero_pp_rank_0_model_states.pt").unlink(), "is missing"),
    (lambda folder: (folder / STATE_FILE).write_text('{"step": 5'), "unreadable"),
])
def test_resume_falls_back_from_a_damaged_newest_checkpoint_and_says_why(tmp_path, damage, reason):
    older, newest = _save(tmp_path, 2), _save(tmp_path, 5)
    damage(newest)
    found, passed_over = resume_checkpoint(tmp_path)
    assert found == older
    assert len(passed_over) == 1 and passed_over[0].startswith("step_5: ") and reason in passed_over[0]


def test_the_resume_point_says_which_checkpoint_it_passed_over(tmp_path, capsys):
    from flexrl_ds.trainer.launch import TrainArgs, resume_point

    _save(tmp_path, 0)
    newest = _save(tmp_path, 1)
    (newest / "policy" / "zero_pp_rank_0_model_states.pt").write_bytes(b"")
    config = tmp_path / "run.json"
    config.write_text('{"seed": 0}')
    checkpoint, start = resume_point(TrainArgs(str(config), "model", "data", str(tmp_path), resume=True))
    assert (checkpoint, start) == (tmp_path / "checkpoints" / "step_0", 1)
    said = capsys.readouterr().out
    assert "checkpoints/step_1: policy/zero_pp_rank_0_model_states.pt has 0 bytes" in said
    assert "passed over" in said and "continuing after step 1" in said


def test_a_full_disk_during_a_save_is_one_clear_error_and_the_previous_checkpoint_stays(tmp_path):
    previous = _save(tmp_path, 3)
    before = _snapshot(previous)

    def disk_full(partial: Path) -> None:
        _rank_files(partial, 6)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(partial / "policy" / "optim_states.pt"))

    with pytest.raises(CheckpointNotWritten) as raised:
        write_checkpoint(tmp_path / "checkpoints" / "step_6", disk_full, lambda partial: None)
    message = str(raised.value)
    assert "step_6" in message and "disk is full" in message and "step_3 is intact" in message
    assert "\n" not in message
    assert _snapshot(previous) == before and checkpoint_problem(previous) is None
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["step_3"]
    assert latest_checkpoint(tmp_path) == previous


class _RemoteError(Exception):
    """An error as Ray hands a worker's exception to the caller: the original as `cause`."""

    def __init__(self, cause: BaseException):
        super().__init__(f"ray::PolicyWorker.save_checkpoint() failed\n{cause}")
        self.cause = cause


def test_a_full_disk_on_a_worker_is_recognised_through_the_remote_error():
    assert is_disk_full(_RemoteError(OSError(errno.ENOSPC, "No space left on device")))
    assert is_disk_full(RuntimeError("write failed")) is False
    try:
        try:
            raise OSError(errno.EDQUOT, "quota")
        except OSError as error:
            raise RuntimeError("torch.save failed") from error
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)


def test_a_failure_other_than_a_full_disk_passes_unchanged(tmp_path):
    with pytest.raises(PermissionError):
        write_checkpoint(tmp_path / "checkpoints" / "step_0", lambda partial: (_ for _ in ()).throw(PermissionError("no")),
                         lambda partial: None)
    assert not any((tmp_path / "checkpoints").iterdir())


def test_saving_a_step_again_replaces_its_folder_whole(tmp_path):
    final = _save(tmp_path, 2)
    (final / "stale").write_text("from an earlier save")
    _save(tmp_path, 2)
    assert not (final / "stale").exists() and checkpoint_problem(final) is None
    assert sorted(path.name for path in final.parent.iterdir()) == ["step_2"]
