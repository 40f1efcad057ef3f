"""Reading JSONL / Parquet datasets into validated `Record`s (format: docs/DATA_FORMAT.md).

`read_dataset(path)` returns one entry per row, in file order: a `Record`, or a `BadRecord` naming
the row and the problem (unparseable line, missing/ill-typed field, marker count mismatch, a media
path escaping the dataset folder, duplicate id). Reading never opens media files; probing does.

Path rules: a relative media path is resolved against the dataset file's folder and must stay
inside it (`..` may not escape); an absolute path is accepted only under the configured media root;
a path whose symbolic links lead outside both is refused too (no file outside them is opened).
Per-item options: record-level `fps`, `max_frames`, `start`, `end` apply to every video and
`max_pixels` to every image; an entry of `images`/`videos` may also be an object
`{"path": ..., "fps": ..., "max_frames": ..., "start": ..., "end": ..., "max_pixels": ...}`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flexrl_ds.common.json_files import looked_for
from flexrl_ds.media.types import IMAGE, VIDEO, BadRecord, MediaItem, Record

MARKER_PATTERN = re.compile(r"<(image|video)>")
KNOWN_FIELDS = {"id", "prompt", "images", "videos", "answer", "data_source", "response",
                "fps", "max_frames", "start", "end", "max_pixels"}
VIDEO_OPTIONS = ("fps", "max_frames", "start", "end", "max_pixels")
IMAGE_OPTIONS = ("max_pixels",)


def read_dataset(path: str | Path, media_root: str | None = None) -> list[Record | BadRecord]:
    """All rows of a `.jsonl`/`.json` (one object per line) or `.parquet` file, validated."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: dataset file not found{looked_for(path)}")
    dataset_dir = path.resolve().parent
    root = Path(media_root).resolve() if media_root else None
    entries: list[Record | BadRecord] = []
    first_row_of_id: dict[str, int] = {}
    for index, row in _iter_rows(path):
        entry = row if isinstance(row, BadRecord) else parse_record(row, index, dataset_dir, root)
        if isinstance(entry, Record):
            if entry.id in first_row_of_id:
                entry = BadRecord(entry.id, f"duplicate id (first at row {first_row_of_id[entry.id]})",
                                  index, "read")
            else:
                first_row_of_id[entry.id] = index
        entries.append(entry)
    return entries


def _iter_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | BadRecord]]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as error:  # pyarrow raises several types for a broken file
            raise ValueError(f"{path}: not a readable Parquet file ({error})") from None
        yield from enumerate(rows)
        return
    if path.is_dir():
        inside = sorted(p.name for p in path.iterdir() if p.suffix.lower() in (".jsonl", ".parquet"))
        raise ValueError(f"{path}: a folder; --data names the dataset file in it"
                         + (f" ({', '.join(inside[:3])} here)" if inside else " (a .jsonl or .parquet file)"))
    if suffix not in (".jsonl", ".json", ".ndjson"):
        raise ValueError(f"{path}: unknown dataset format {suffix!r} (use .jsonl or .parquet)")
    try:
        handle = path.open("rb")
    except OSError as error:
        raise ValueError(f"{path}: the dataset file cannot be read ({error.strerror or error})") from None
    with handle:
        index = 0
        for line_number, raw in enumerate(handle, 1):
            row = _json_row(raw, line_number, index)
            if row is None:
                continue
            yield index, row
            index += 1


def _json_row(raw: bytes, line_number: int, index: int) -> dict[str, Any] | BadRecord | None:
    """A JSONL line as a row, a `BadRecord` naming the line and what is wrong, or None (blank)."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        return BadRecord(f"line {line_number}", f"not UTF-8 text ({error.reason} at byte {error.start})", index, "read")
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        return BadRecord(f"line {line_number}", f"not valid JSON ({error.msg})", index, "read")
    if not isinstance(row, dict):
        return BadRecord(f"line {line_number}", "a record must be a JSON object", index, "read")
    return row


def parse_record(row: dict[str, Any], index: int, dataset_dir: Path,
                 media_root: Path | None = None) -> Record | BadRecord:
    """Validate one row; a problem becomes a `BadRecord` with the row's id (or `row N`)."""
    raw_id = row.get("id")
    if not isinstance(raw_id, (str, int)) or isinstance(raw_id, bool) or raw_id == "":
        reason = "missing field 'id'" if raw_id is None else f"field 'id' must be a string or integer, got {raw_id!r}"
        return BadRecord(f"row {index}", reason, index, "read")
    record_id = str(raw_id)
    try:
        return _parse_record(row, record_id, index, dataset_dir, media_root)
    except ValueError as error:
        return BadRecord(record_id, str(error), index, "read")


def _parse_record(row: dict[str, Any], record_id: str, index: int, dataset_dir: Path,
                  media_root: Path | None) -> Record:
    prompt = row.get("prompt")
    if "prompt" not in row:
        raise ValueError("missing field 'prompt'")
    if not isinstance(prompt, str):
        raise ValueError(f"field 'prompt' must be a string, got {type(prompt).__name__}")
    images = _media_list(row, "images", IMAGE, IMAGE_OPTIONS, dataset_dir, media_root)
    videos = _media_list(row, "videos", VIDEO, VIDEO_OPTIONS, dataset_dir, media_root)
    markers = MARKER_PATTERN.findall(prompt)
    for kind, listed in ((IMAGE, images), (VIDEO, videos)):
        count = markers.count(kind)
        if count != len(listed):
            raise ValueError(
                f"prompt has {count} <{kind}> marker(s) but '{kind}s' lists {len(listed)} file(s)"
            )
    queues = {IMAGE: iter(images), VIDEO: iter(videos)}
    items = tuple(next(queues[kind]) for kind in markers)
    return Record(
        id=record_id, prompt=prompt, items=items, index=index,
        answer=_optional_text(row, "answer"), data_source=_optional_text(row, "data_source"),
        response=_optional_text(row, "response"),
        extra={key: value for key, value in row.items() if key not in KNOWN_FIELDS},
    )


def _optional_text(row: dict[str, Any], key: str) -> str | None:
    value = row.get(key)
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise ValueError(f"field '{key}' must be a string, got {type(value).__name__}")
    return value


def _media_list(row: dict[str, Any], key: str, kind: str, option_names: tuple[str, ...],
                dataset_dir: Path, media_root: Path | None) -> list[MediaItem]:
    entries = row.get(key)
    if entries is None:
        return []
    if not isinstance(entries, (list, tuple)):
        raise ValueError(f"field '{key}' must be a list, got {type(entries).__name__}")
    record_options = {name: row.get(name) for name in option_names if row.get(name) is not None}
    items = []
    for position, entry in enumerate(entries):
        where = f"{key}[{position}]"
        options = dict(record_options)
        if isinstance(entry, dict):
            unknown = set(entry) - {"path", *option_names}
            if unknown:
                raise ValueError(f"{where}: unknown option(s) {sorted(unknown)}")
            options.update({name: entry[name] for name in option_names if entry.get(name) is not None})
            entry = entry.get("path")
        if not isinstance(entry, str) or not entry:
            raise ValueError(f"{where}: a media path must be a non-empty string, got {entry!r}")
        resolved = resolve_media_path(entry, dataset_dir, media_root, where)
        items.append(MediaItem(kind=kind, path=resolved, source=entry, **_check_options(options, where)))
    return items


def _check_options(options: dict[str, Any], where: str) -> dict[str, Any]:
    checked: dict[str, Any] = {}
    for name, value in options.items():
        integral = name in ("max_frames", "max_pixels")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integral and value != int(value)):
            raise ValueError(f"{where}: option '{name}' must be a {'whole ' if integral else ''}number, got {value!r}")
        if value < 0 or (value == 0 and name != "start"):
            raise ValueError(f"{where}: option '{name}' must be positive, got {value!r}")
        checked[name] = int(value) if integral else float(value)
    if "start" in checked and "end" in checked and checked["end"] <= checked["start"]:
        raise ValueError(f"{where}: 'end' ({checked['end']}) must be after 'start' ({checked['start']})")
    return checked


def resolve_media_path(raw: str, dataset_dir: Path, media_root: Path | None, where: str = "media") -> str:
    """Apply the path rules; raise ValueError naming `where` when the path is not allowed. Symbolic
    links are followed for the check: a link inside the dataset folder (or the media root) to a file
    outside both is refused as the path itself would be."""
    if os.path.isabs(raw):
        normalised = Path(os.path.normpath(raw))
        if media_root is None:
            raise ValueError(f"{where}: absolute path {raw!r} not allowed (no media root configured)")
        if not _is_within(normalised, media_root):
            raise ValueError(f"{where}: absolute path {raw!r} is outside the media root {str(media_root)!r}")
    else:
        normalised = Path(os.path.normpath(dataset_dir / raw))
        if not _is_within(normalised, dataset_dir):
            raise ValueError(f"{where}: path {raw!r} escapes the dataset folder")
    real = Path(os.path.realpath(normalised))
    if not _is_within(real, dataset_dir) and not (media_root is not None and _is_within(real, media_root)):
        raise ValueError(f"{where}: path {raw!r} leads through a symbolic link to {str(real)!r}, outside the "
                         "dataset folder" + ("" if media_root is None else " and the media root")
                         + " (flexrl.data.media_root names a folder whose files may be linked to)")
    return str(normalised)


def _is_within(path: Path, folder: Path) -> bool:
    try:
        path.relative_to(folder)
    except ValueError:
        return False
    return True


def record_to_row(record: Record, dataset_dir: Path) -> dict[str, Any]:
    """A JSON row for `record` with media paths relative to `dataset_dir` (for writing datasets)."""
    row: dict[str, Any] = {"id": record.id, "prompt": record.prompt}
    for key, kind in (("images", IMAGE), ("videos", VIDEO)):
        row[key] = [os.path.relpath(item.path, dataset_dir) for item in record.items if item.kind == kind]
    for key in ("answer", "data_source", "response"):
        if getattr(record, key) is not None:
            row[key] = getattr(record, key)
    return row
