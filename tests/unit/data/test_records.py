"""Dataset reading: JSONL/Parquet, field validation, path rules, marker counts."""

from __future__ import annotations

import json

import pytest

from flexrl_ds.media.records import read_dataset
from flexrl_ds.media.types import BadRecord, Record


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


GOOD = [
    {"id": "geo-1", "prompt": "<image>\nFind angle ABC.", "images": ["img/a.png"], "videos": [],
     "answer": "42", "data_source": "geo3k"},
    {"id": 7, "prompt": "<video> then <image> and <video>", "images": ["b.jpg"],
     "videos": ["v/1.mp4", {"path": "v/2.mp4", "fps": 1, "start": 2, "end": 5.5}], "fps": 4, "max_frames": 16,
     "answer": 3, "extra_field": [1, 2]},
    {"id": "text-only", "prompt": "no media here", "response": "ok"},
]


def test_jsonl_records_keep_marker_order_and_options(tmp_path):
    entries = read_dataset(write_jsonl(tmp_path / "train.jsonl", GOOD))
    assert all(isinstance(entry, Record) for entry in entries)
    first, second, third = entries
    assert first.items[0].path == str(tmp_path / "img" / "a.png") and first.answer == "42"
    assert [item.kind for item in second.items] == ["video", "image", "video"]
    assert [item.source for item in second.items] == ["v/1.mp4", "b.jpg", "v/2.mp4"]
    assert (second.items[0].fps, second.items[0].max_frames) == (4.0, 16)
    assert (second.items[2].fps, second.items[2].start, second.items[2].end) == (1.0, 2.0, 5.5)
    assert second.id == "7" and second.answer == "3" and second.extra == {"extra_field": [1, 2]}
    assert third.items == () and third.response == "ok" and third.index == 2


def test_parquet_reads_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [dict(row, videos=[v if isinstance(v, str) else v["path"] for v in row.get("videos", [])])
            for row in GOOD[:1] + GOOD[2:]]
    keys = sorted({key for row in rows for key in row})  # Parquet needs one schema for all rows
    rows = [{key: row.get(key) for key in keys} for row in rows]
    for row in rows:
        row["id"] = str(row["id"])
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    write_jsonl(tmp_path / "train.jsonl", rows)
    assert read_dataset(tmp_path / "train.parquet") == read_dataset(tmp_path / "train.jsonl")


@pytest.mark.parametrize("row, reason", [
    ({"prompt": "<image>", "images": ["a.png"]}, "missing field 'id'"),
    ({"id": "x", "prompt": 5}, "field 'prompt' must be a string"),
    ({"id": "x", "images": []}, "missing field 'prompt'"),
    ({"id": "x", "prompt": "<image><image>", "images": ["a.png"]}, "2 <image> marker(s) but 'images' lists 1"),
    ({"id": "x", "prompt": "text", "videos": ["a.mp4"]}, "0 <video> marker(s) but 'videos' lists 1"),
    ({"id": "x", "prompt": "<image>", "images": ["../outside.png"]}, "escapes the dataset folder"),
    ({"id": "x", "prompt": "<image>", "images": ["img/../../outside.png"]}, "escapes the dataset folder"),
    ({"id": "x", "prompt": "<image>", "images": ["/etc/passwd"]}, "no media root configured"),
    ({"id": "x", "prompt": "<video>", "videos": ["a.mp4"], "fps": "fast"}, "option 'fps' must be a number"),
    ({"id": "x", "prompt": "<video>", "videos": [{"path": "a.mp4", "start": 3, "end": 1}]}, "'end' (1.0) must be after"),
    ({"id": "x", "prompt": "<image>", "images": [{"path": "a.png", "speed": 2}]}, "unknown option"),
    ({"id": "x", "prompt": "<image>", "images": "a.png"}, "field 'images' must be a list"),
])
def test_invalid_rows_become_bad_records(tmp_path, row, reason):
    (entry,) = read_dataset(write_jsonl(tmp_path / "train.jsonl", [row]))
    assert isinstance(entry, BadRecord) and entry.stage == "read"
    assert reason in entry.reason
    assert entry.id == (row["id"] if "id" in row else "row 0")


def test_relative_dotdot_inside_the_folder_is_allowed(tmp_path):
    (entry,) = read_dataset(write_jsonl(tmp_path / "d.jsonl", [
        {"id": "x", "prompt": "<image>", "images": ["img/../img/a.png"]}]))
    assert entry.items[0].path == str(tmp_path / "img" / "a.png")


def test_absolute_paths_only_under_the_media_root(tmp_path):
    root = tmp_path / "root"
    rows = [{"id": "in", "prompt": "<image>", "images": [str(root / "a.png")]},
            {"id": "out", "prompt": "<image>", "images": [str(tmp_path / "b.png")]},
            {"id": "sneaky", "prompt": "<image>", "images": [str(root / ".." / "b.png")]}]
    inside, outside, sneaky = read_dataset(write_jsonl(tmp_path / "d.jsonl", rows), media_root=str(root))
    assert isinstance(inside, Record) and inside.items[0].path == str(root / "a.png")
    assert isinstance(outside, BadRecord) and "outside the media root" in outside.reason
    assert isinstance(sneaky, BadRecord) and "outside the media root" in sneaky.reason


def test_unparseable_lines_and_duplicate_ids_are_reported_in_place(tmp_path):
    rows = [GOOD[0], "{not json", '["a list"]', GOOD[0], GOOD[2]]
    entries = read_dataset(write_jsonl(tmp_path / "d.jsonl", rows))
    assert [type(entry).__name__ for entry in entries] == ["Record", "BadRecord", "BadRecord", "BadRecord", "Record"]
    assert entries[1].id == "line 2" and "not valid JSON" in entries[1].reason
    assert "must be a JSON object" in entries[2].reason
    assert entries[3].id == "geo-1" and "duplicate id" in entries[3].reason
    assert [entry.index for entry in entries] == [0, 1, 2, 3, 4]


def test_missing_or_unknown_dataset_file_is_a_user_error(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        read_dataset(tmp_path / "nope.jsonl")
    (tmp_path / "d.csv").write_text("id\n")
    with pytest.raises(ValueError, match="unknown dataset format"):
        read_dataset(tmp_path / "d.csv")
    with pytest.raises(ValueError, match=r"a folder; --data names the dataset file in it \(a .jsonl or .parquet"):
        read_dataset(tmp_path)
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"a folder; --data names the dataset file in it \(train.jsonl here\)"):
        read_dataset(tmp_path)


def test_a_symbolic_link_out_of_the_dataset_folder_is_refused_one_inside_is_followed(tmp_path):
    """The check follows links (os.path.realpath as the reference): a link to a file outside the dataset
    folder, or a linked folder leading out, is a bad record; a link within the folder, or into the
    media root, is allowed."""
    import os

    data, outside, root = tmp_path / "data", tmp_path / "outside", tmp_path / "root"
    for folder in (data, outside, root):
        folder.mkdir()
    for folder in (outside, root, data):
        (folder / "a.png").write_bytes(b"png")
    os.symlink(outside / "a.png", data / "link_out.png")
    os.symlink(outside, data / "dir_out")
    os.symlink(data / "a.png", data / "link_in.png")
    os.symlink(root / "a.png", data / "link_root.png")
    rows = [{"id": name, "prompt": "<image>", "images": [name]}
            for name in ("link_out.png", "dir_out/a.png", "link_in.png", "link_root.png")]
    path = write_jsonl(data / "d.jsonl", rows)
    link_out, dir_out, link_in, link_root = read_dataset(path)
    for bad in (link_out, dir_out):
        assert isinstance(bad, BadRecord) and "symbolic link" in bad.reason
        assert str(outside / "a.png") == os.path.realpath(data / bad.id) and str(outside) in bad.reason
    assert isinstance(link_in, Record) and isinstance(link_root, BadRecord)
    assert isinstance(read_dataset(path, media_root=str(root))[3], Record)


def test_a_line_that_is_not_utf8_is_a_bad_record_the_rest_are_read(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(GOOD[0]).encode() + b"\n\xff\xfe garbage\n" + json.dumps(GOOD[2]).encode() + b"\n")
    first, bad, last = read_dataset(path)
    assert isinstance(first, Record) and isinstance(last, Record)
    assert isinstance(bad, BadRecord) and bad.id == "line 2" and "not UTF-8" in bad.reason
