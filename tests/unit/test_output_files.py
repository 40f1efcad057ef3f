"""Output files named by the user: their folders are made, and paths that cannot be files are named."""

from __future__ import annotations

import json

import pytest

from flexrl_ds.cli.main import main
from flexrl_ds.common.output_files import output_file


def test_missing_folders_are_made(tmp_path):
    path = output_file(tmp_path / "a" / "b" / "plan.json")
    assert path.parent.is_dir() and not path.exists()


@pytest.mark.parametrize("where, said", [
    ("folder", "is a folder; give the name of a file to write"),
    ("under_a_file", "cannot make its folder, {file} is a file or a broken link"),
    ("deeper_under_a_file", "cannot make its folder, {file} is a file or a broken link"),
])
def test_paths_that_cannot_be_files_are_named(tmp_path, where, said):
    file = tmp_path / "taken"
    file.write_text("keep me")
    path = {"folder": tmp_path, "under_a_file": file / "x.json", "deeper_under_a_file": file / "y" / "x.json"}[where]
    with pytest.raises(ValueError) as raised:
        output_file(path)
    assert str(raised.value) == f"{path}: " + said.format(file=file)
    assert file.read_text() == "keep me"


def test_a_broken_link_in_the_way_is_named(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match=r"link/x.json: cannot make its folder, .*link is a file or a broken link"):
        output_file(tmp_path / "link" / "x.json")


def test_make_workload_writes_into_a_new_folder(tmp_path):
    out = tmp_path / "new" / "w.json"
    assert main(["make-workload", "--mix", "image-heavy", "--num", "4", "--seed", "0", "--out", str(out)]) == 0
    assert len(json.loads(out.read_text())["sequences"]) > 0


def test_an_output_that_is_a_folder_is_one_line(tmp_path, capsys):
    assert main(["make-workload", "--mix", "image-heavy", "--num", "4", "--seed", "0", "--out", str(tmp_path)]) == 2
    said = capsys.readouterr().err.strip()
    assert said == f"flexrl make-workload: error: {tmp_path}: is a folder; give the name of a file to write"


def test_a_benchmark_names_a_folder_in_the_way_before_it_runs(tmp_path, capsys):
    """`bench sp --json DIR` would otherwise find out after spawning its ranks and timing."""
    assert main(["bench", "sp", "--nproc", "1", "--json", str(tmp_path)]) == 2
    said = capsys.readouterr()
    assert said.err.strip() == f"flexrl bench: error: {tmp_path}: is a folder; give the name of a file to write"
    assert "[bench sp]" not in said.out
