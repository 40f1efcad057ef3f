"""A tiny scoring dataset with real media files, for tests and demos of `flexrl logprobs`.

`write_scoring_dataset(folder)` writes random PNG images, short H.264 MP4 videos (torchcodec's
encoder; skipped when `with_video` is False or no encoder is available) and `samples.jsonl` in the
docs/DATA_FORMAT.md layout with a `response` field. `random_plan_for` makes a valid FlexUlysses plan over
given sequences with mixed degrees (every rank gets work), for tests that want degree variety the
planner would not pick for tiny inputs.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from flexrl_ds.media.video_encoding import encode_video
from flexrl_ds.planning.plan import Pack, Plan, validate_plan

_WORDS = ("the answer is angle circle two red ball boy because first then find line point area "
          "three seven so we have value option B C yes no").split()


def _text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high)))


def write_scoring_dataset(folder: str | Path, num_records: int = 6, seed: int = 0, with_video: bool = True) -> Path:
    """Write media and `samples.jsonl` under `folder`; returns the JSONL path."""
    from PIL import Image

    folder = Path(folder)
    (folder / "media").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    np_rng = np.random.default_rng(seed)
    records = []
    for index in range(num_records):
        kind = ("image", "video", "mixed", "text")[index % 4] if with_video else ("image", "text")[index % 2]
        record: dict[str, Any] = {"id": f"r{index}", "images": [], "videos": [], "response": _text(rng, 3, 12)}
        prompt = []
        if kind in ("image", "mixed"):
            for image_index in range(1 if kind == "image" else 2):
                height, width = rng.choice([(56, 84), (70, 100), (112, 56), (90, 90)])
                path = f"media/r{index}_{image_index}.png"
                Image.fromarray(np_rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(folder / path)
                record["images"].append(path)
                prompt.append("<image>")
        if kind in ("video", "mixed"):
            path = f"media/r{index}.mp4"
            write_video(folder / path, num_frames=rng.choice([6, 8, 10]), height=56, width=84, fps=4, rng=np_rng)
            record["videos"].append(path)
            prompt.append("<video>")
        record["prompt"] = "".join(prompt) + "\n" + _text(rng, 2, 10) + "?"
        records.append(record)
    out = folder / "samples.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in records))
    return out


def write_video(path: str | Path, num_frames: int, height: int, width: int, fps: int, rng) -> None:
    """A short random-noise MP4 (smooth enough to survive H.264; media/video_encoding.py)."""
    import torch

    base = rng.integers(0, 255, (3, height // 4, width // 4), dtype=np.uint8)
    frames = []
    for index in range(num_frames):
        frame = np.roll(base, index, axis=2).repeat(4, axis=1).repeat(4, axis=2)
        frames.append(frame)
    encode_video(path, torch.from_numpy(np.stack(frames)), fps)


def random_plan_for(lengths: dict[str, int], world_size: int, p_max: int, seed: int):
    """A valid plan over `lengths` mixing degrees 1..p_max; the first sequence spans all p_max ranks."""
    rng = random.Random(seed)
    degrees = [d for d in (1, 2, 4, 8, 16) if d <= p_max]
    blocks: dict[tuple[int, int], list[str]] = {}
    ids = list(lengths)
    rng.shuffle(ids)
    for index, seq_id in enumerate(ids):
        degree = p_max if index == 0 else rng.choice(degrees)
        first = rng.randrange(world_size // degree) * degree
        blocks.setdefault((degree, first), []).append(seq_id)
    covered = {r for (degree, first) in blocks for r in range(first, first + degree)}
    for rank in sorted(set(range(world_size)) - covered):  # a rank without work borrows a sequence
        donor = max((k for k in blocks if len(blocks[k]) > 1), key=lambda k: len(blocks[k]), default=None)
        if donor is None:
            break
        blocks[(1, rank)] = [blocks[donor].pop()]
    packs = tuple(Pack(id=i, degree=d, ranks=tuple(range(f, f + d)), sequences=tuple(seqs))
                  for i, ((d, f), seqs) in enumerate(sorted(blocks.items(), key=lambda kv: (-kv[0][0], kv[0][1]))))
    rank_order = {r: tuple(p.id for p in packs if r in p.ranks) for r in range(world_size)}
    plan = Plan(world_size=world_size, p_max=p_max, packs=packs, rank_order=rank_order)
    validate_plan(plan, list(lengths))
    return plan


def text_only_copy(data_path: str | Path, out_name: str = "text_only.jsonl") -> Path:
    """The same records without media (markers, images, videos removed), next to the original."""
    data_path = Path(data_path)
    rows = [json.loads(line) for line in data_path.read_text().splitlines() if line.strip()]
    for row in rows:
        row["prompt"] = row["prompt"].replace("<image>", "").replace("<video>", "")
        row["images"], row["videos"] = [], []
    out = data_path.with_name(out_name)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out
