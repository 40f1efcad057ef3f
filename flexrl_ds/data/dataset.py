"""A probed dataset and the bad-record policy.

`probe_dataset(path, preprocessor)` reads every row, probes its media (metadata only) and applies
the policy of `DataConfig.bad_record_policy`:
- `skip`: bad records are left out; the samples keep dataset order.
- `replace`: each bad record's slot is filled by the next good record after it in dataset order
  (wrapping around), under the sample id `<bad id>-><substitute id>`; the batch keeps its size and
  which record stands in for which is reported in `replacements`.
- `error`: the first bad record stops with a ValueError naming its id and reason.
Every bad record is kept in `bad` with its reason, so nothing changes silently. A record that only
fails later, while decoding, goes through `ProbedDataset.resolve_failure` (same policy).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from flexrl_ds.data.preprocess import SamplePreprocessor
from flexrl_ds.data.records import read_dataset
from flexrl_ds.data.types import BadRecord, SampleMeta


@dataclass
class ProbedDataset:
    """Samples ready for the loader, with every bad record and every replacement reported."""

    samples: list[SampleMeta]
    """Trainable samples in dataset order (replacements sit in their bad record's slot)."""
    bad: list[BadRecord]
    """All bad records found, in dataset order."""
    policy: str
    """The bad-record policy applied."""
    replacements: dict[str, str] = field(default_factory=dict)
    """Bad record id -> id of the record that stands in for it (policy replace)."""
    good: list[SampleMeta] = field(default_factory=list)
    """Good samples only, in dataset order (substitutes are drawn from these)."""

    def resolve_failure(self, failed: SampleMeta, bad: BadRecord) -> SampleMeta | None:
        """Policy for a sample whose media failed at materialisation: the substitute (replace),
        None (skip), or ValueError (error). The failure is recorded in `bad`."""
        self.bad.append(bad)
        if self.policy == "error":
            raise ValueError(f"record {bad.id!r}: {bad.reason}")
        known_bad = {entry.id for entry in self.bad}
        self.good = [meta for meta in self.good if meta.record.id not in known_bad]
        if self.policy == "skip":
            return None
        return self._substitute(failed.record.index, bad.id, known_bad)

    def _substitute(self, index: int, bad_id: str, known_bad: set[str]) -> SampleMeta:
        candidates = [meta for meta in self.good if meta.record.id not in known_bad]
        if not candidates:
            raise ValueError(f"record {bad_id!r} is bad and no good record is left to replace it")
        after = [meta for meta in candidates if meta.record.index > index]
        chosen = (after or candidates)[0]
        self.replacements[bad_id] = chosen.record.id
        return dataclasses.replace(chosen, id=f"{bad_id}->{chosen.record.id}")

    def summary(self) -> str:
        stages = Counter(entry.stage for entry in self.bad)
        detail = ", ".join(f"{stage} {count}" for stage, count in sorted(stages.items()))
        text = f"{len(self.good)} good, {len(self.bad)} bad" + (f" ({detail})" if detail else "")
        if self.replacements:
            text += f", {len(self.replacements)} replaced"
        return text + f", policy {self.policy}"


def apply_policy(entries: list[SampleMeta | BadRecord], policy: str) -> ProbedDataset:
    """Build the sample list from probed entries (in dataset order) under `policy`."""
    good = [entry for entry in entries if isinstance(entry, SampleMeta)]
    bad = [entry for entry in entries if isinstance(entry, BadRecord)]
    if policy == "error" and bad:
        raise ValueError(f"record {bad[0].id!r}: {bad[0].reason}")
    dataset = ProbedDataset(samples=[], bad=bad, policy=policy, good=list(good))
    known_bad = {entry.id for entry in bad}
    for position, entry in enumerate(entries):
        if isinstance(entry, SampleMeta):
            dataset.samples.append(entry)
        elif policy == "replace":
            index = entry.index if entry.index >= 0 else position
            dataset.samples.append(dataset._substitute(index, entry.id, known_bad))
    return dataset


def probe_entries(path: str | Path, preprocessor: SamplePreprocessor,
                  progress: Callable[[int, int], None] | None = None) -> list[SampleMeta | BadRecord]:
    """Read and probe every row (bad rows stay in place as `BadRecord`s)."""
    rows = read_dataset(path, media_root=preprocessor.config.media_root)
    entries: list[SampleMeta | BadRecord] = []
    for done, row in enumerate(rows, 1):
        entries.append(row if isinstance(row, BadRecord) else preprocessor.probe(row))
        if progress is not None:
            progress(done, len(rows))
    return entries


def probe_dataset(path: str | Path, preprocessor: SamplePreprocessor,
                  progress: Callable[[int, int], None] | None = None) -> ProbedDataset:
    """Read, probe and apply the configured bad-record policy."""
    return apply_policy(probe_entries(path, preprocessor, progress), preprocessor.config.bad_record_policy)
