"""`flexrl bench probe`: what the controller pays (metadata probing) against what ShadowLoader moves
off it (decode + preprocess), per record of a dataset.

Measures, over all good records: seconds per record to probe (headers only) and to materialise
(decode, resize, normalise, patchify), and bytes per record of the pickled `SampleMeta` against the
bytes of the pixel tensors it stands for. Both paths run in this one process, one after the other,
so the ratio is a like-for-like comparison on the same machine.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from flexrl_ds.loader.config import DataConfig
from flexrl_ds.media.dataset import probe_entries
from flexrl_ds.media.preprocess import SamplePreprocessor
from flexrl_ds.media.types import BadMediaError, SampleMeta


@dataclass
class ProbeBenchResult:
    num_records: int
    num_good: int
    probe_s_per_record: float
    materialize_s_per_record: float
    meta_bytes_per_record: float
    pixel_bytes_per_record: float
    vision_tokens_per_record: float

    def to_json(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        return "\n".join([
            f"records: {self.num_records} ({self.num_good} good), "
            f"{self.vision_tokens_per_record:.0f} vision tokens/record",
            f"{'':24}{'probe (controller)':>20}{'materialise':>16}{'ratio':>10}",
            f"{'seconds / record':<24}{self.probe_s_per_record:>20.5f}{self.materialize_s_per_record:>16.5f}"
            f"{self.materialize_s_per_record / max(self.probe_s_per_record, 1e-12):>10.1f}",
            f"{'bytes / record':<24}{self.meta_bytes_per_record:>20.0f}{self.pixel_bytes_per_record:>16.0f}"
            f"{self.pixel_bytes_per_record / max(self.meta_bytes_per_record, 1):>10.1f}",
        ])


def bench_probe(data: str | Path, preprocessor: SamplePreprocessor) -> ProbeBenchResult:
    import PIL.Image  # noqa: F401  (imports and backend loading are not part of the measurement)

    preprocessor.video_backend  # noqa: B018
    start = time.perf_counter()
    entries = probe_entries(data, preprocessor)
    probe_seconds = time.perf_counter() - start
    good = [entry for entry in entries if isinstance(entry, SampleMeta)]
    if not good:
        raise ValueError(f"{data}: no good record to materialise")
    pixel_bytes, start = 0, time.perf_counter()
    for meta in good:
        try:
            tensors = preprocessor.materialize(meta)
        except BadMediaError:
            continue
        pixel_bytes += sum(t.pixel_values.numel() * t.pixel_values.element_size() for t in tensors.values())
    materialize_seconds = time.perf_counter() - start
    meta_bytes = sum(len(pickle.dumps(meta)) for meta in good)
    return ProbeBenchResult(
        num_records=len(entries), num_good=len(good),
        probe_s_per_record=probe_seconds / len(entries),
        materialize_s_per_record=materialize_seconds / len(good),
        meta_bytes_per_record=meta_bytes / len(good), pixel_bytes_per_record=pixel_bytes / len(good),
        vision_tokens_per_record=sum(meta.vision_tokens for meta in good) / len(good),
    )


def bench_probe_config(data: str | Path, data_config: DataConfig) -> ProbeBenchResult:
    """`bench_probe` with the `SamplePreprocessor` of `data_config` (`flexrl bench probe`)."""
    return bench_probe(data, SamplePreprocessor(data_config))
