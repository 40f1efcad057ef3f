"""Bad-input cases of `flexrl bench faults` (bench/faults.py): a good dataset with bad rows mixed in.

`mixed_dataset(folder)` writes real media (PNG, H.264 MP4) for `NUM_GOOD` good records and one row of
each `BAD_KINDS` kind into one JSONL file, a folder `outside/` next to the dataset folder that rows
try to reach (`..`, a symbolic link to a file, a linked folder), and a pickle that would write a file
if it were ever unpickled. `run_mixed` reads, probes and decodes it through the offline path of the
training loader's bad-record policy (media/dataset.py `probe_dataset`: the same `BadRecordPolicy`
code, policy `skip`), with a Python audit hook recording every file opened. A kind's row passes when
its record is reported once, with a reason naming the fault, and never trained on; the good records'
row when each of them is trained on exactly once. Two more files: a Parquet dataset with malformed
rows (the good rows read, the bad ones reported) and an unreadable dataset file (one line naming it).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from flexrl_ds.bench.datasets import video_frames, write_video
from flexrl_ds.bench.faults import Case, Observed
from flexrl_ds.media.config import MediaConfig
from flexrl_ds.media.dataset import probe_dataset
from flexrl_ds.media.preprocess import SamplePreprocessor
from flexrl_ds.media.records import read_dataset
from flexrl_ds.media.types import BadMediaError, BadRecord

NUM_GOOD = 8
IMAGE_SIDE = 112
TOKENS_CAP = 64
"""`max_vision_tokens_per_sample` of the run: the oversized row's 12 images exceed it, a good row's one
item does not."""


@dataclass(frozen=True)
class BadKind:
    name: str
    injected: str
    expected: str
    """A phrase the reported reason must contain."""


BAD_KINDS = (
    BadKind("truncated_video", "an MP4 cut in half (its index lost)", "cannot open video"),
    BadKind("truncated_video_frames", "an MP4 with its index first, cut in half (frames lost)", "video"),
    BadKind("zero_frame_video", "an MP4 with no frame", "cannot open video"),
    BadKind("wrong_codec_video", "an audio-only MP4 given as a video", "cannot open video"),
    BadKind("corrupt_video", "an .mp4 of random bytes", "cannot open video"),
    BadKind("broken_image", "a PNG cut in half", "cannot read image"),
    BadKind("zero_size_image", "an empty .png", "cannot read image"),
    BadKind("pickle_as_image", "a pickle that writes a file when loaded, named .png", "cannot read image"),
    BadKind("missing_file", "a path to no file", "missing file"),
    BadKind("path_escape", "a path with '..' leaving the dataset folder", "escapes the dataset folder"),
    BadKind("symlink_escape", "a symbolic link in the dataset folder to a file outside", "symbolic link"),
    BadKind("symlink_dir_escape", "a linked folder leading outside the dataset folder", "symbolic link"),
    BadKind("placeholder_mismatch", "two <image> markers, one image", "marker"),
    BadKind("oversized_sample", f"12 images, more vision tokens than the cap of {TOKENS_CAP}", "oversized"),
    BadKind("malformed_jsonl_row", "a line that is not JSON", "not valid JSON"),
    BadKind("not_utf8_row", "a line of bytes that are not UTF-8", "not UTF-8"),
    BadKind("missing_prompt", "a row without 'prompt'", "missing field 'prompt'"),
)


@dataclass
class MixedRun:
    """What reading, probing and decoding the mixed dataset gave."""

    trained: list[str]
    """Record ids of the samples that decoded, in step order (duplicates kept)."""
    reported: dict[str, list[str]]
    """Record id -> the reasons it was reported with."""
    good_ids: list[str]
    bad_ids: dict[str, str]
    """Kind name -> its record id."""
    outside: Path
    pickle_marker: Path
    opened: list[str] = field(default_factory=list)
    """Every file path opened while reading, probing and decoding (Python's `open` audit event)."""
    seconds: float = 0.0


def _media_config():

    side = 28 * 28
    return MediaConfig(image_min_pixels=side * 4, image_max_pixels=side * 16, video_min_pixels=side * 4,
                       video_max_pixels=side * 8, video_max_frames=4, max_vision_tokens_per_sample=TOKENS_CAP,
                       bad_record_policy="skip")


def _image(path: Path, seed: int) -> None:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


class _WritesAFile:
    """Unpickling it calls `open(marker, "w")`: proof, if the file appears, that something unpickled it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _bad_media(folder: Path, outside: Path) -> dict[str, list[str]]:
    """Writes the bad files; kind -> the media paths its row names."""

    write_video(folder / "good_v.mp4", 8, 64, 48, 4, seed=1)
    data = (folder / "good_v.mp4").read_bytes()
    (folder / "cut.mp4").write_bytes(data[: len(data) // 2])
    paths = {"truncated_video": ["cut.mp4"], "corrupt_video": ["random.mp4"], "zero_frame_video": ["zero.mp4"]}
    (folder / "random.mp4").write_bytes(os.urandom(4096))
    import cv2

    writer = cv2.VideoWriter(str(folder / "zero.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), 8, (64, 48))  # type: ignore[attr-defined]
    writer.release()
    import torch
    from torchcodec.encoders import AudioEncoder, VideoEncoder

    AudioEncoder(torch.rand(1, 16000) * 0.1, sample_rate=16000).to_file(str(folder / "audio.mp4"))
    VideoEncoder(video_frames(30, 64, 48), frame_rate=8).to_file(str(folder / "faststart.mp4"),
                                                                extra_options={"movflags": "+faststart"})
    data = (folder / "faststart.mp4").read_bytes()
    (folder / "faststart_cut.mp4").write_bytes(data[: len(data) // 2])
    (folder / "faststart.mp4").unlink()
    _image(folder / "whole.png", 99)
    data = (folder / "whole.png").read_bytes()
    (folder / "cut.png").write_bytes(data[: len(data) // 2])
    (folder / "empty.png").write_bytes(b"")
    (folder / "payload.png").write_bytes(pickle.dumps(_WritesAFile(str(folder.parent / "UNPICKLED"))))
    _image(outside / "secret.png", 7)
    os.symlink(outside / "secret.png", folder / "link.png")
    os.symlink(outside, folder / "linked_dir")
    return {**paths, "wrong_codec_video": ["audio.mp4"], "truncated_video_frames": ["faststart_cut.mp4"],
            "broken_image": ["cut.png"], "zero_size_image": ["empty.png"], "pickle_as_image": ["payload.png"],
            "missing_file": ["nothing_here.png"], "path_escape": ["../outside/secret.png"],
            "symlink_escape": ["link.png"], "symlink_dir_escape": ["linked_dir/secret.png"],
            "placeholder_mismatch": ["whole.png"], "oversized_sample": ["whole.png"] * 12}


def _row_of(kind: str, record_id: str, media: list[str]) -> str:
    if kind == "malformed_jsonl_row":
        return '{"id": "' + record_id + '", "prompt": '
    if kind == "not_utf8_row":
        return '{"id": "' + record_id + '", "prompt": "\udcff"}'
    if kind == "missing_prompt":
        return json.dumps({"id": record_id, "images": []})
    key = "videos" if media[0].endswith(".mp4") else "images"
    markers = "<video>" if key == "videos" else "<image>" * (2 if kind == "placeholder_mismatch" else len(media))
    return json.dumps({"id": record_id, "prompt": f"{markers} Describe it.", key: media})


def mixed_dataset(root: Path) -> tuple[Path, list[str], dict[str, str]]:
    """(dataset file, good record ids, kind -> bad record id); the bad rows between the good ones."""
    folder, outside = root / "data", root / "outside"
    folder.mkdir(parents=True)
    outside.mkdir()
    media = _bad_media(folder, outside)

    good_rows, good_ids = [], []
    for index in range(NUM_GOOD):
        record_id = f"good-{index}"
        if index % 2:
            write_video(folder / f"g{index}.mp4", 8, 64, 48, 4, seed=index)
            row = {"id": record_id, "prompt": "<video> What moves?", "videos": [f"g{index}.mp4"]}
        else:
            _image(folder / f"g{index}.png", index)
            row = {"id": record_id, "prompt": "<image> What is it?", "images": [f"g{index}.png"]}
        good_rows.append(json.dumps(row))
        good_ids.append(record_id)
    bad_ids = {kind.name: f"bad-{kind.name}" for kind in BAD_KINDS}
    bad_rows = [_row_of(kind.name, bad_ids[kind.name], media.get(kind.name, [])) for kind in BAD_KINDS]
    lines = [row for pair in zip(good_rows + [""] * len(bad_rows), bad_rows + [""] * len(good_rows)) for row in pair
             if row]
    for kind in ("malformed_jsonl_row", "not_utf8_row"):  # no id can be read from these: reported by line
        bad_ids[kind] = f"line {lines.index(bad_rows[[k.name for k in BAD_KINDS].index(kind)]) + 1}"
    path = folder / "train.jsonl"
    path.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape") + b"\n")
    return path, good_ids, bad_ids


_HOOKED = False
_AUDIT: list[list[str]] = []
"""The open lists being filled (the audit hook, once added, cannot be removed: it appends only while one is)."""


def _audit(event: str, args: tuple) -> None:
    if _AUDIT and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _AUDIT[-1].append(os.fsdecode(args[0]))


@lru_cache(maxsize=None)
def run_mixed(root: Path) -> MixedRun:
    """Build, read, probe and decode the mixed dataset once per scratch folder (every row of the
    bad-input cases reads the same run)."""

    path, good_ids, bad_ids = mixed_dataset(root)
    global _HOOKED
    if not _HOOKED:
        sys.addaudithook(_audit)
        _HOOKED = True
    opened: list[str] = []
    _AUDIT.append(opened)
    started = time.perf_counter()
    try:
        preprocessor = SamplePreprocessor(_media_config())
        probed = probe_dataset(path, preprocessor)
        trained = []
        for meta in list(probed.samples):
            try:
                preprocessor.materialize(meta)
                trained.append(meta.record.id)
            except BadMediaError as error:
                probed.resolve_failure(meta, error.bad)
    finally:
        _AUDIT.remove(opened)
    reported: dict[str, list[str]] = {}
    for bad in probed.bad:
        reported.setdefault(bad.id, []).append(f"{bad.stage}: {bad.reason}")
    return MixedRun(trained, reported, good_ids, bad_ids, root / "outside", root / "UNPICKLED", opened,
                    time.perf_counter() - started)


def _scratch_root(folder: Path) -> Path:
    return folder.parent / "mixed_dataset"


def _kind_case(kind: BadKind) -> Case:
    def run(folder: Path) -> Observed:
        mixed = run_mixed(_scratch_root(folder))
        record_id = mixed.bad_ids[kind.name]
        reasons = mixed.reported.get(record_id, [])
        trained = mixed.trained.count(record_id)
        passed = len(reasons) == 1 and kind.expected in reasons[0] and trained == 0
        seen = f"reported as {record_id!r}, {reasons[0]}" if reasons else "not reported"
        if trained:
            seen += f"; trained on {trained} time(s)"
        return Observed(seen, passed, lost=0 if reasons or trained else 1, duplicated=max(0, trained - 1),
                        detect_s=mixed.seconds)
    return Case(f"bad_input:{kind.name}", kind.injected,
                f"reported once naming it ('{kind.expected}'), never trained on, the run goes on", run)


def _good_records(folder: Path) -> Observed:
    mixed = run_mixed(_scratch_root(folder))
    lost = [record_id for record_id in mixed.good_ids if record_id not in mixed.trained]
    duplicated = len(mixed.trained) - len(set(mixed.trained))
    strays = sorted(set(mixed.trained) - set(mixed.good_ids))
    seen = (f"{len(set(mixed.trained) & set(mixed.good_ids))}/{len(mixed.good_ids)} good records decoded and "
            f"trained on, {len(mixed.reported)} bad rows reported, in {mixed.seconds:.2f} s")
    if lost or strays:
        seen += f"; lost {lost}, bad ones trained on {strays}"
    return Observed(seen, not lost and not duplicated and not strays, len(lost), duplicated, mixed.seconds)


def _outside_root(folder: Path) -> Observed:
    mixed = run_mixed(_scratch_root(folder))
    outside = os.path.realpath(mixed.outside)
    touched = sorted({path for path in mixed.opened if os.path.realpath(path).startswith(outside + os.sep)})
    refused = [kind for kind in ("path_escape", "symlink_escape", "symlink_dir_escape")
               if mixed.reported.get(mixed.bad_ids[kind])]
    seen = (f"{len(mixed.opened)} files opened while reading, probing and decoding, {len(touched)} of them "
            f"outside the dataset folder; {len(refused)}/3 escaping rows refused before any open")
    return Observed(seen + (f": {touched}" if touched else ""), not touched and len(refused) == 3)


def _no_unpickling(folder: Path) -> Observed:
    mixed = run_mixed(_scratch_root(folder))
    reasons = mixed.reported.get(mixed.bad_ids["pickle_as_image"], [])
    ran = mixed.pickle_marker.exists()
    seen = f"the payload's file {'WAS written' if ran else 'was not written'}; the row: {reasons or 'not reported'}"
    return Observed(seen, bool(reasons) and not ran)


def _parquet_rows(folder: Path) -> Observed:
    import pyarrow as pa
    import pyarrow.parquet as pq


    rows = {"id": ["p0", None, "p2", "p3", "p4"], "prompt": ["hello", "no id", None, "hi", "<image> two"],
            "images": [[], [], [], [], []]}
    pq.write_table(pa.table(rows), folder / "train.parquet")
    started = time.perf_counter()
    entries = read_dataset(folder / "train.parquet")
    seconds = time.perf_counter() - started
    bad = [entry for entry in entries if isinstance(entry, BadRecord)]
    good = [entry.id for entry in entries if not isinstance(entry, BadRecord)]
    seen = f"read {good}; reported {[(entry.id, entry.reason) for entry in bad]}"
    return Observed(seen, good == ["p0", "p3"] and len(bad) == 3, lost=max(0, 2 - len(good)), detect_s=seconds)


def _unreadable_file(folder: Path) -> Observed:

    broken = folder / "train.parquet"
    broken.write_bytes(b"PAR1 this is no Parquet file")
    started = time.perf_counter()
    try:
        read_dataset(broken)
    except ValueError as error:
        message = str(error)
        return Observed(f"ValueError: {message}", str(broken) in message and "\n" not in message,
                        detect_s=time.perf_counter() - started)
    return Observed("read without an error", False)


CASES = [_kind_case(kind) for kind in BAD_KINDS] + [
    Case("bad_input:good_records", f"{len(BAD_KINDS)} kinds of bad rows between {NUM_GOOD} good ones",
         "every good record trained on exactly once", _good_records),
    Case("bad_input:parquet_rows", "a Parquet file with a row without id, one with a null prompt, one with a "
         "marker and no image", "the good rows read, each bad one reported", _parquet_rows),
    Case("bad_input:unreadable_file", "a dataset file that is not Parquet", "one line naming the file, before "
         "any worker starts", _unreadable_file),
    Case("security:outside_dataset_root", "'..', a symbolic link to a file and a linked folder leading out of "
         "the dataset folder", "no file outside the dataset folder opened (links resolved; Python's open audit "
         "event)", _outside_root),
    Case("security:no_pickle_from_data", "a pickle that writes a file when loaded, as a dataset image",
         "never unpickled: a bad record", _no_unpickling),
]
