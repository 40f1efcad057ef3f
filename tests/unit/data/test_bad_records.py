"""Bad media and records: reported with id and reason, never a crash; skip / replace / error policies."""

from __future__ import annotations

import json
import shutil

import pytest

from flexrl_ds.media.bad_records import FATE_BAD_SUBSTITUTE, FATE_NO_SUBSTITUTE, FATE_SKIPPED, fate_replaced
from flexrl_ds.media.config import MediaConfig
from flexrl_ds.media.dataset import apply_policy, probe_dataset, probe_entries
from flexrl_ds.media.preprocess import SamplePreprocessor
from flexrl_ds.media.video_backends import available_backends
from flexrl_ds.media.types import BadMediaError, BadRecord, MediaItem, Record, SampleMeta

CONFIG = MediaConfig(image_min_pixels=28 * 28 * 4, image_max_pixels=28 * 28 * 64,
                    video_min_pixels=28 * 28 * 4, video_max_pixels=28 * 28 * 16, video_max_frames=8)


def record(record_id: str, path, index: int = 0) -> Record:
    kind = "video" if str(path).endswith(".mp4") else "image"
    return Record(id=record_id, prompt=f"<{kind}>", items=(MediaItem(kind, str(path), source=str(path)),), index=index)


@pytest.mark.parametrize("backend", ["torchcodec", "opencv"])
@pytest.mark.parametrize("name, expected", [
    ("missing.png", "missing file"),
    ("garbage.png", "cannot read image"),
    ("cut.png", "cannot read image"),
    ("cut.mp4", "cannot open video"),
    ("zero.mp4", "cannot open video"),
    ("one.mp4", "at least 2 are needed"),
])
def test_bad_media_found_while_probing(media, backend, name, expected):
    if backend not in available_backends():
        pytest.skip(f"video backend {backend} not available")
    path = media.bad.get(name, media.folder / name)
    preprocessor = SamplePreprocessor(MediaConfig(video_backend=backend))
    bad = preprocessor.probe(record(f"rec-{name}", path, index=3))
    assert isinstance(bad, BadRecord), bad
    assert (bad.id, bad.index, bad.stage) == (f"rec-{name}", 3, "probe")
    assert expected in bad.reason and name in bad.reason


def test_truncated_video_with_intact_index(media):
    """torchcodec sees the missing frames while probing; OpenCV only while decoding."""
    if set(available_backends()) != {"torchcodec", "opencv"}:
        pytest.skip("needs both torchcodec and OpenCV")
    path = media.bad["faststart_cut.mp4"]
    bad = SamplePreprocessor(CONFIG).probe(record("cut", path))
    assert isinstance(bad, BadRecord) and "truncated video" in bad.reason
    preprocessor = SamplePreprocessor(MediaConfig(**{**CONFIG.__dict__, "video_backend": "opencv"}))
    meta = preprocessor.probe(record("cut", path))
    assert isinstance(meta, SampleMeta)
    with pytest.raises(BadMediaError) as caught:
        preprocessor.materialize(meta)
    assert caught.value.bad.id == "cut" and caught.value.bad.stage == "materialize"
    assert isinstance(preprocessor.process(record("cut", path)), BadRecord)


def test_oversized_sample(media):
    preprocessor = SamplePreprocessor(MediaConfig(**{**CONFIG.__dict__, "max_vision_tokens_per_sample": 10}))
    bad = preprocessor.probe(record("big", media.videos[0]))
    assert isinstance(bad, BadRecord) and "oversized" in bad.reason and "10" in bad.reason


def test_image_corrupted_after_probing_fails_at_materialise(media, tmp_path):
    path = tmp_path / "later.png"
    shutil.copy(media.images[0], path)
    preprocessor = SamplePreprocessor(CONFIG)
    meta = preprocessor.probe(record("later", path))
    path.write_bytes(b"now broken")
    with pytest.raises(BadMediaError, match="later"):
        preprocessor.materialize(meta)
    shutil.copy(media.images[1], path)  # a different size than probed: shapes would not match
    with pytest.raises(BadMediaError, match="metadata said"):
        preprocessor.materialize(meta)


@pytest.fixture
def mixed_dataset(media, tmp_path):
    for name in ("garbage.png", "cut.mp4"):
        shutil.copy(media.bad[name], tmp_path / name)
    for index, source in enumerate(media.images[:2] + media.videos[:1]):
        shutil.copy(source, tmp_path / f"good{index}{source.suffix}")
    rows = [
        {"id": "g0", "prompt": "<image>", "images": ["good0.png"]},
        {"id": "b-garbage", "prompt": "<image>", "images": ["garbage.png"]},
        {"id": "g1", "prompt": "<image>", "images": ["good1.jpg"]},
        {"id": "b-count", "prompt": "<image>", "images": []},
        {"id": "b-cut", "prompt": "<video>", "videos": ["cut.mp4"]},
        {"id": "g2", "prompt": "<video>", "videos": ["good2.mp4"]},
        {"id": "b-missing", "prompt": "<video>", "videos": ["nothing.mp4"]},
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_skip_policy_keeps_order_and_reports_every_bad_record(mixed_dataset):
    dataset = probe_dataset(mixed_dataset, SamplePreprocessor(CONFIG))
    assert [meta.id for meta in dataset.samples] == ["g0", "g1", "g2"]
    assert [(bad.id, bad.stage) for bad in dataset.bad] == [
        ("b-garbage", "probe"), ("b-count", "read"), ("b-cut", "probe"), ("b-missing", "probe")]
    assert dataset.summary() == "3 good, 4 bad (probe 3, read 1), policy skip"
    assert (dataset.counts.num_bad, dataset.counts.num_skipped) == (4, 4)
    assert dataset.report.fates == [FATE_SKIPPED] * 4


def test_replace_policy_draws_substitutes_from_the_tail_of_the_epoch(mixed_dataset):
    """Rows: g0 b-garbage g1 b-count b-cut g2 b-missing. Steps of 2 in file order: step 0 = rows
    0, 1; b-garbage's substitute is reserved from the tail: row 6 (bad, reported), then row 5 (g2).
    Step 1 = rows 2, 3; b-count's substitute: row 4 (bad), then no unused row is left."""
    config = MediaConfig(**{**CONFIG.__dict__, "bad_record_policy": "replace"})
    dataset = probe_dataset(mixed_dataset, SamplePreprocessor(config), global_batch=2)
    assert [[meta.id for meta in step] for step in dataset.steps] == [["g0", "b-garbage->g2"], ["g1"]]
    assert dataset.replacements == {"b-garbage": "g2"}
    assert [bad.id for bad in dataset.report.bad_records] == ["b-garbage", "b-missing", "b-count", "b-cut"]
    # each one's fate: b-garbage's slot went to g2; b-missing and b-cut were drawn for it and for b-count
    # and are bad themselves; b-count's slot found no substitute
    assert dataset.report.fates == [fate_replaced("g2"), FATE_BAD_SUBSTITUTE, FATE_NO_SUBSTITUTE, FATE_BAD_SUBSTITUTE]
    counts = dataset.counts
    assert (counts.num_bad, counts.num_replaced, counts.num_unreplaced) == (4, 1, 1)
    replaced = dataset.steps[0][1]
    assert replaced.record.id == "g2" and replaced.placeholders()[0].sample_id == "b-garbage->g2"
    again = probe_dataset(mixed_dataset, SamplePreprocessor(config), global_batch=2)
    assert [meta.id for meta in again.samples] == [meta.id for meta in dataset.samples]  # deterministic
    # the whole file as one step: every row is in the window, nothing is left to draw from
    whole = probe_dataset(mixed_dataset, SamplePreprocessor(config))
    assert [meta.id for meta in whole.samples] == ["g0", "g1", "g2"] and whole.replacements == {}
    assert whole.counts.num_unreplaced == 4


def test_error_policy_names_the_first_bad_record(mixed_dataset):
    config = MediaConfig(**{**CONFIG.__dict__, "bad_record_policy": "error"})
    with pytest.raises(ValueError, match="record 'b-garbage': image 0 \\(garbage.png\\): cannot read image"):
        probe_dataset(mixed_dataset, SamplePreprocessor(config))
    with pytest.raises(ValueError, match="record 'b-garbage'"):
        probe_dataset(mixed_dataset, SamplePreprocessor(config), global_batch=2)


def test_failure_at_materialise_follows_the_policy(mixed_dataset):
    entries = probe_entries(mixed_dataset, SamplePreprocessor(CONFIG))
    dataset = apply_policy(entries, "replace", global_batch=3)  # step 0: g0, b-garbage->g2, g1
    failed = dataset.samples[0]  # g0 breaks later, while decoding
    bad = BadRecord("g0", "cannot decode frames", failed.record.index, "materialize")
    substitute = dataset.resolve_failure(failed, bad)
    # row 6 went to b-garbage's draw (bad), row 5 (g2) too; the next unused tail row is 4 (bad), then 3 (bad)
    assert substitute is None and dataset.counts.num_unreplaced == 1
    assert [meta.id for meta in dataset.samples] == ["b-garbage->g2", "g1"] and dataset.bad[-1] is bad
    assert all(meta.record.id != "g0" for meta in dataset.good)
    skip = apply_policy(entries, "skip")
    assert skip.resolve_failure(skip.samples[0], bad) is None and [m.id for m in skip.samples] == ["g1", "g2"]


@pytest.mark.parametrize("policy, batch, shuffle", [("replace", 2, False), ("replace", 3, True), ("skip", 2, True)])
def test_offline_path_and_training_loader_choose_the_same_samples(mixed_dataset, policy, batch, shuffle):
    """The same bad dataset through `probe_dataset` (offline) and the loader's step composition
    (`StepSource`, probing with the same preprocessor) gives the same steps and replacements."""
    from flexrl_ds.loader.config import LoaderConfig
    from flexrl_ds.loader.proxy_loader import StepSource
    from flexrl_ds.media.records import read_dataset

    config = MediaConfig(**{**CONFIG.__dict__, "bad_record_policy": policy})
    preprocessor = SamplePreprocessor(config)
    offline = probe_dataset(mixed_dataset, preprocessor, global_batch=batch, seed=4, shuffle=shuffle)
    loader_config = LoaderConfig(global_batch=batch, seed=4, shuffle=shuffle)
    source = StepSource(read_dataset(mixed_dataset), loader_config,
                        lambda records: [preprocessor.probe(record) for record in records], bad_record_policy=policy)
    steps = [source.compose() for _ in offline.steps]
    assert [[p.meta.id for p in step.prompts] for step in steps] == [[m.id for m in s] for s in offline.steps]
    assert {k: v for step in steps for k, v in step.replacements.items()} == offline.replacements
    reasons = [(b.id, b.reason) for step in steps for b in step.bad_records]
    assert reasons == [(b.id, b.reason) for b in offline.report.bad_records]
    files = {"b-garbage": "garbage.png", "b-cut": "cut.mp4", "b-missing": "nothing.mp4", "b-count": "marker"}
    assert reasons and all(files[record_id] in reason for record_id, reason in reasons)  # id + cause
    assert source.stats.num_bad == offline.counts.num_bad == len(reasons)
