"""Seeded generator of real multimodal datasets (media files + train.jsonl) for tests, demos and
loader benchmarks: `flexrl make-dataset`.

Records follow the three public workload profiles (bench/workloads.py): `image` (Geo3K-like geometry
diagrams, PNG or JPEG, 1 in 10 records has two), `short_video` (NExTQA-like clips) and `long_video`
(LongVILA-like, longer and wider). Mixes weight the profiles as in the FlexRL paper. Scales set the
media sizes: `small` and `medium` are scaled down so that media are small and fast to encode;
`nextqa` has clips of realistic sizes (20-60 s, 360p-720p, 30 fps, as NExTQA's), for the data-loading
ablation: decoding them is what costs a centralised loader its time. Videos are generated and encoded
by bench/synthetic_video.py (H.264 with torchcodec, else MPEG-4 part 2 with OpenCV), in worker
processes where there is much to encode.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flexrl_ds.bench.synthetic_video import VideoJob, available_cpus, encode_videos, video_frames, write_video

__all__ = ["MIXES", "SCALES", "TASKS", "DatasetSummary", "make_dataset", "make_records", "video_frames",
           "write_video"]

MIXES = {
    "image-heavy": {"image": 5, "short_video": 2, "long_video": 1},
    "video-heavy": {"image": 1, "short_video": 2, "long_video": 5},
    "only-video": {"image": 0, "short_video": 1, "long_video": 1},
    "only-image": {"image": 1, "short_video": 0, "long_video": 0},  # for peers that take no videos (TRL)
}


@dataclass(frozen=True)
class Scale:
    """Media sizes of one scale (all ranges inclusive)."""

    image_side: tuple[int, int]
    """Image sides in pixels."""
    short_video_size: tuple[tuple[int, int], tuple[int, int]]
    """(smallest (w, h), largest (w, h)) of short videos; sides are made even (H.264 4:2:0)."""
    short_video_seconds: tuple[float, float]
    long_video_size: tuple[tuple[int, int], tuple[int, int]]
    long_video_seconds: tuple[float, float]
    video_fps: int
    """Frame rate of generated videos."""
    prompt_words: tuple[int, int]
    """Words of prompt text."""


SCALES = {
    "small": Scale(image_side=(40, 200), short_video_size=((64, 48), (128, 96)),
                   short_video_seconds=(1.0, 3.0), long_video_size=((96, 54), (160, 90)),
                   long_video_seconds=(3.0, 6.0), video_fps=8, prompt_words=(10, 40)),
    "medium": Scale(image_side=(200, 1000), short_video_size=((320, 240), (480, 360)),
                    short_video_seconds=(4.0, 12.0), long_video_size=((448, 252), (640, 360)),
                    long_video_seconds=(10.0, 24.0), video_fps=8, prompt_words=(30, 200)),
    "nextqa": Scale(image_side=(200, 1000), short_video_size=((640, 360), (854, 480)),
                    short_video_seconds=(20.0, 40.0), long_video_size=((960, 540), (1280, 720)),
                    long_video_seconds=(40.0, 60.0), video_fps=30, prompt_words=(10, 40)),
}
"""`nextqa`: NExTQA's clips are ~44 s on average, mostly 640x360 to 640x480, at ~30 fps; both video
profiles are NExTQA-like here (the long one 40-60 s at 540p-720p)."""

PARALLEL_PIXEL_FRAMES = 10**9
"""With `workers` None, videos holding more pixels than this in all (~1,100 frames at 720p) are
encoded in one worker process per CPU; fewer in this process (starting workers costs seconds)."""

WORDS = ("angle triangle circle radius chord tangent segment measure find the of what is why did "
         "boy girl ball pick up walk run after before happen scene show person table door").split()


@dataclass
class DatasetSummary:
    path: Path
    num_records: int
    num_images: int
    num_videos: int
    bytes_on_disk: int


KEYWORDS = ("girl", "ball", "circle", "door", "table", "boy")
"""Answers of the `keyword` task: words of the tiny models' tokenizer corpus (flexrl_ds/models/tiny.py)."""
TASKS = ("qa", "keyword")
"""qa: geometry numbers / choice letters as answers (rule reward "accuracy"); keyword: the prompt asks
to answer with one word, which is the record's answer (reward "keyword": the share of the response
spelled by that word), a task a tiny random model can learn within minutes on a CPU."""


def make_dataset(out: str | Path, mix: str, num: int, scale: str = "small", seed: int = 0,
                 parquet: bool = False, progress: Callable[[int, int], None] | None = None,
                 task: str = "qa", workers: int | None = None) -> DatasetSummary:
    """Write `num` records of `mix` with their media under `out`; returns counts. `workers`:
    processes encoding the videos (None: one per CPU where there is much to encode,
    `PARALLEL_PIXEL_FRAMES`, else this process); `progress(records done, num)` as records complete."""
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    rows, jobs = make_records(out, mix, num, scale, seed, task)
    if workers is None:
        workers = available_cpus() if sum(job.pixel_frames for job in jobs) > PARALLEL_PIXEL_FRAMES else 1
    done = num - len(jobs)  # image records: written already

    def one_more(job: VideoJob) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, num)

    if progress is not None:
        progress(done, num)  # the images are written; the videos start
    encode_videos(jobs, workers, one_more)
    out = Path(out)
    path = out / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    if parquet:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), out / "train.parquet")
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return DatasetSummary(path, len(rows), sum(len(row["images"]) for row in rows),
                          sum(len(row["videos"]) for row in rows), size)


def make_records(out: str | Path, mix: str, num: int, scale: str = "small", seed: int = 0,
                 task: str = "qa") -> tuple[list[dict], list[VideoJob]]:
    """The records of `make_dataset`, their images written under `out`, their videos returned as
    jobs for `encode_videos` (one per video record, in record order)."""
    if mix not in MIXES:
        raise ValueError(f"--mix {mix!r}: choose one of {', '.join(MIXES)}")
    if task not in TASKS:
        raise ValueError(f"--task {task!r}: choose one of {', '.join(TASKS)}")
    if scale not in SCALES:
        raise ValueError(f"--scale {scale!r}: choose one of {', '.join(SCALES)}")
    if num <= 0:
        raise ValueError(f"--num must be positive, got {num}")
    out = Path(out)
    (out / "media" / "img").mkdir(parents=True, exist_ok=True)
    (out / "media" / "vid").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    profiles, weights = zip(*[(name, weight) for name, weight in MIXES[mix].items() if weight > 0])
    rows, jobs = [], []
    for index in range(num):
        profile = rng.choices(profiles, weights)[0]
        row, job = _make_record(out, index, profile, SCALES[scale], rng)
        if task == "keyword":
            row = _keyword_task(row, rng)
        rows.append(row)
        jobs += [job] if job is not None else []
    return rows, jobs


def _make_record(out: Path, index: int, profile: str, scale: Scale,
                 rng: random.Random) -> tuple[dict, VideoJob | None]:
    """A record (its images written) and its video's job, if it has one."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*scale.prompt_words)))
    if profile == "image":
        count = 2 if rng.random() < 0.1 else 1
        images = []
        for k in range(count):
            suffix = "png" if rng.random() < 0.5 else "jpg"
            relative = f"media/img/{index:05d}_{k}.{suffix}"
            _write_image(out / relative, rng.randint(*scale.image_side), rng.randint(*scale.image_side), rng)
            images.append(relative)
        prompt = "<image>\n" * count + text + "?"
        return {"id": f"img-{index:05d}", "prompt": prompt, "images": images, "videos": [],
                "answer": str(rng.randint(1, 180)), "data_source": "geo3k"}, None
    if profile == "short_video":
        size_range, seconds, source = scale.short_video_size, scale.short_video_seconds, "nextqa"
    else:
        size_range, seconds, source = scale.long_video_size, scale.long_video_seconds, "longvila"
    (min_w, min_h), (max_w, max_h) = size_range
    width, height = _even(rng.randint(min_w, max_w)), _even(rng.randint(min_h, max_h))
    num_frames = max(2, round(rng.uniform(*seconds) * scale.video_fps))
    relative = f"media/vid/{index:05d}.mp4"
    job = VideoJob(str(out / relative), num_frames, width, height, scale.video_fps, seed=rng.randrange(2**31))
    options = " ".join(f"{letter}. {rng.choice(WORDS)}" for letter in "ABCD")
    return {"id": f"{'sv' if profile == 'short_video' else 'lv'}-{index:05d}",
            "prompt": f"<video>\n{text}? {options}", "images": [], "videos": [relative],
            "answer": rng.choice("ABCD"), "data_source": source}, job


def _keyword_task(row: dict, rng: random.Random) -> dict:
    keyword = rng.choice(KEYWORDS)
    return {**row, "prompt": f"{row['prompt']} Answer with the word {keyword}, as often as you can.",
            "answer": keyword, "data_source": "keyword"}


def _even(value: int) -> int:
    return max(2, value - value % 2)


def _write_image(path: Path, width: int, height: int, rng: random.Random) -> None:
    """A geometry-like diagram: a triangle, a circle and labelled points on a light background."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (width, height), tuple(rng.randint(200, 255) for _ in range(3)))
    draw = ImageDraw.Draw(image)
    points = [(rng.randint(0, width - 1), rng.randint(0, height - 1)) for _ in range(3)]
    draw.polygon(points, outline=(20, 20, 20), fill=tuple(rng.randint(100, 220) for _ in range(3)))
    radius = max(2, min(width, height) // 5)
    centre = (rng.randint(0, width - 1), rng.randint(0, height - 1))
    draw.ellipse([centre[0] - radius, centre[1] - radius, centre[0] + radius, centre[1] + radius],
                 outline=(200, 30, 30), width=2)
    for label, point in zip("ABC", points):
        draw.text(point, label, fill=(0, 0, 120))
    if path.suffix == ".jpg":
        image.save(path, quality=90)
    else:
        image.save(path)
