"""`flexrl make-dataset` then `flexrl inspect-data --materialize --json` on the generated data."""

from __future__ import annotations

import json
import shutil

import pytest

from flexrl_ds.cli.main import main

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("dataset")
    assert main(["make-dataset", "--mix", "image-heavy", "--num", "12", "--scale", "small",
                 "--seed", "3", "--out", str(out), "--parquet"]) == 0
    return out


def test_make_dataset_writes_records_and_media(dataset):
    rows = [json.loads(line) for line in (dataset / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and len({row["id"] for row in rows}) == 12
    for row in rows:
        assert set(row) >= {"id", "prompt", "images", "videos", "answer", "data_source"}
        for path in row["images"] + row["videos"]:
            assert (dataset / path).stat().st_size > 0
        assert row["prompt"].count("<image>") == len(row["images"])
        assert row["prompt"].count("<video>") == len(row["videos"])
    assert any(row["videos"] for row in rows) and any(row["images"] for row in rows)
    assert (dataset / "train.parquet").exists()


def test_make_dataset_is_seeded(dataset, tmp_path):
    """The same seed writes the same records and, with torchcodec's encoder, byte-identical media
    (x264 made other bytes now and then with its default rate control or threads, so it encodes at a
    constant QP on one thread; the OpenCV fallback, used where torchcodec cannot load, is not held
    to this)."""
    assert main(["make-dataset", "--mix", "image-heavy", "--num", "12", "--scale", "small", "--seed", "3",
                 "--out", str(tmp_path)]) == 0
    assert (tmp_path / "train.jsonl").read_text() == (dataset / "train.jsonl").read_text()
    pytest.importorskip("torchcodec.encoders")
    media = sorted(path.relative_to(dataset) for path in (dataset / "media").rglob("*") if path.is_file())
    assert any(path.suffix == ".mp4" for path in media)
    for path in media:
        assert (tmp_path / path).read_bytes() == (dataset / path).read_bytes(), path


def test_make_dataset_in_worker_processes_writes_the_same_dataset(dataset, tmp_path):
    """`--workers 2`: the videos encoded in two spawned processes (what `--scale nextqa` does on every
    core) are the records and, with torchcodec's encoder, the bytes of the in-process run."""
    assert main(["make-dataset", "--mix", "image-heavy", "--num", "12", "--scale", "small", "--seed", "3",
                 "--workers", "2", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "train.jsonl").read_text() == (dataset / "train.jsonl").read_text()
    videos = sorted(path.relative_to(dataset) for path in (dataset / "media" / "vid").iterdir())
    assert len(videos) >= 2 and all((tmp_path / path).stat().st_size > 0 for path in videos)
    pytest.importorskip("torchcodec.encoders")
    for path in videos:
        assert (tmp_path / path).read_bytes() == (dataset / path).read_bytes(), path


def test_inspect_data_materialize_json(dataset, tmp_path, capsys):
    shutil.copytree(dataset, tmp_path / "d")
    data = tmp_path / "d" / "train.jsonl"
    (tmp_path / "d" / "broken.mp4").write_bytes(b"\x00" * 100)
    with data.open("a") as handle:
        handle.write(json.dumps({"id": "bad-video", "prompt": "<video>", "videos": ["broken.mp4"]}) + "\n")
        handle.write(json.dumps({"id": "bad-escape", "prompt": "<image>", "images": ["../x.png"]}) + "\n")
    capsys.readouterr()
    assert main(["inspect-data", "--data", str(data), "--materialize", "--json"]) == 0
    captured = capsys.readouterr()
    results = [json.loads(line) for line in captured.out.splitlines()]
    assert len(results) == 14
    for result in results:
        assert set(result) == {"id", "ok", "reason", "vision_tokens", "predicted_shapes", "actual_shapes", "mismatch"}
    good, bad = results[:12], results[12:]
    assert all(r["ok"] and r["reason"] is None and r["mismatch"] is False for r in good)
    assert all(r["actual_shapes"] == r["predicted_shapes"] and r["vision_tokens"] > 0 for r in good)
    assert [r["id"] for r in bad] == ["bad-video", "bad-escape"]
    assert "cannot open video" in bad[0]["reason"] and "escapes the dataset folder" in bad[1]["reason"]
    assert "14 records: 12 ok, 2 bad" in captured.err


def test_inspect_data_text_and_parquet(dataset, tmp_path, capsys):
    assert main(["inspect-data", "--data", str(dataset / "train.parquet"), "--plot", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 13 and out[-1].startswith("12 records: 12 ok, 0 bad")
    assert all(" ok " in line and "vision tokens" in line for line in out[:12])


def test_inspect_data_user_errors(tmp_path, capsys):
    assert main(["inspect-data", "--data", str(tmp_path / "none.jsonl")]) == 2
    assert "dataset file not found" in capsys.readouterr().err


def test_inspect_data_reads_the_flexrl_data_section(dataset, tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 8, "flexrl": {"data": {
        "video_min_pixels": 3136, "video_max_pixels": 25088, "max_vision_tokens_per_sample": 20}}}))
    assert main(["inspect-data", "--data", str(dataset / "train.jsonl"), "--config", str(config), "--json"]) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    oversized = [r for r in results if not r["ok"]]
    assert oversized and all("oversized" in r["reason"] and "max_vision_tokens_per_sample=20" in r["reason"]
                             for r in oversized)
    assert all(r["vision_tokens"] <= 20 for r in results if r["ok"])


def test_inspect_data_with_a_qwen3_vl_model_predicts_its_processors_tokens(dataset, tmp_path, capsys):
    """`--model` of a tiny Qwen3-VL: each record's vision tokens are those of transformers' own Qwen3-VL
    processors (the image processor at patch 16; the video processor's frame sampling and whole-video
    pixel budget over the source frame count and fps)."""
    import transformers
    from torchcodec.decoders import VideoDecoder
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    model = tmp_path / "q3"
    assert main(["make-tiny-model", "--out", str(model), "--arch", "qwen3-vl"]) == 0
    capsys.readouterr()
    assert main(["inspect-data", "--data", str(dataset / "train.jsonl"), "--model", str(model), "--json"]) == 0
    results = {r["id"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    image_processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(model)
    saved = json.loads((model / "video_preprocessor_config.json").read_text())
    video_processor = Qwen3VLVideoProcessor(**{k: v for k, v in saved.items()
                                               if k not in ("video_processor_type", "processor_class")})
    image_kwargs = {"patch_size": 16, "merge_size": 2, "size": dict(image_processor.size)}
    videos = 0
    for row in map(json.loads, (dataset / "train.jsonl").read_text().splitlines()):
        from PIL import Image

        patches = 0
        for path in row["images"]:
            width, height = Image.open(dataset / path).size
            patches += image_processor.get_number_of_image_patches(height, width, image_kwargs)
        for path in row["videos"]:
            meta = VideoDecoder(str(dataset / path)).metadata
            frames = video_processor.sample_frames(VideoMetadata(total_num_frames=meta.num_frames,
                                                                 fps=meta.average_fps), fps=saved["fps"])
            patches += video_processor.get_num_of_video_patches(len(frames), meta.height, meta.width)
            videos += 1
        assert results[row["id"]]["vision_tokens"] == patches // 4, row["id"]
    assert videos > 0
