"""A probed dataset under the bad-record policy (offline tools: tests, inspection, scripts).

`probe_dataset(path, preprocessor)` reads every row, probes its media (metadata only) and applies
`MediaConfig.bad_record_policy` with the *same* code as the training loader
(`bad_records.BadRecordPolicy`, semantics in its module docstring): rows are taken in windows of
`global_batch` from one epoch's order (file order unless `shuffle`), `skip` drops a bad row's
slot, `replace` fills it with a row reserved from the tail of the epoch's order, `error` stops
with the record id and reason. With the loader's `global_batch`, `seed` and `shuffle`, the result
is exactly the loader's first epoch. With `global_batch=None` the whole file is one step: every
row is in the window, no unused row is left to draw from, so `replace` drops bad slots as `skip`
does (counted in `counts.num_unreplaced`). Every bad record is kept in `bad` with its reason, and
a record that only fails later, while decoding, goes through `ProbedDataset.resolve_failure`
(same policy, same slot).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flexrl_ds.media.bad_records import BadRecordCounts, BadRecordPolicy, StepReport, is_bad, select_steps
from flexrl_ds.media.preprocess import SamplePreprocessor
from flexrl_ds.media.records import read_dataset
from flexrl_ds.media.types import BadRecord, SampleMeta


@dataclass
class ProbedDataset:
    """Samples ready to train on, step by step, with every bad record and replacement reported."""

    steps: list[list[SampleMeta]]
    """Samples of each step, in slot order (substitutes sit in their bad record's slot)."""
    bad: list[BadRecord]
    """All bad records of the file in dataset order, then those found while decoding."""
    policy: str
    """The bad-record policy applied."""
    replacements: dict[str, str] = field(default_factory=dict)
    """Bad record id -> id of the record that stands in for it (policy replace)."""
    good: list[SampleMeta] = field(default_factory=list)
    """Samples that probed fine, in dataset order (minus those that later failed to decode)."""
    chooser: BadRecordPolicy | None = field(default=None, repr=False)
    """The policy object (its epoch order and counts) that later decode failures go through."""
    report: StepReport = field(default_factory=StepReport, repr=False)
    """The policy's report over all steps (bad records in the order met, replacements)."""

    @property
    def samples(self) -> list[SampleMeta]:
        """All steps' samples, concatenated."""
        return [sample for step in self.steps for sample in step]

    @property
    def counts(self) -> BadRecordCounts:
        return self.chooser.counts if self.chooser is not None else BadRecordCounts()

    def resolve_failure(self, failed: SampleMeta, bad: BadRecord) -> SampleMeta | None:
        """Policy for a sample whose media failed at materialisation, in its slot: the substitute
        (replace), None (skip: the slot is dropped), or ValueError (error). Recorded in `bad`."""
        assert self.chooser is not None, "resolve_failure needs a dataset built by apply_policy"
        step, slot = next((s, k) for s, samples in enumerate(self.steps)
                          for k, sample in enumerate(samples) if sample.id == failed.id)
        self.bad.append(bad)
        self.good = [meta for meta in self.good if meta.record.id != bad.id]
        substitute = self.chooser.resolve(step, bad, self.report, failed_id=failed.id)
        self.replacements.clear()
        self.replacements.update(self.report.replacements)
        if substitute is None:
            del self.steps[step][slot]
        else:
            self.steps[step][slot] = substitute
        return substitute

    def summary(self) -> str:
        stages = Counter(entry.stage for entry in self.bad)
        detail = ", ".join(f"{stage} {count}" for stage, count in sorted(stages.items()))
        text = f"{len(self.good)} good, {len(self.bad)} bad" + (f" ({detail})" if detail else "")
        if self.replacements:
            text += f", {len(self.replacements)} replaced"
        return text + f", policy {self.policy}"


def apply_policy(entries: list[SampleMeta | BadRecord], policy: str, global_batch: int | None = None,
                 seed: int = 0, shuffle: bool = False) -> ProbedDataset:
    """Compose the steps of one epoch from probed entries (dataset order) under `policy`."""
    steps, report, chooser = select_steps(entries, policy, global_batch, seed, shuffle)
    bad: list[Any] = [entry for entry in entries if is_bad(entry)]
    if policy == "error" and bad:  # a bad row outside every window (the epoch's remainder)
        raise ValueError(f"record {bad[0].id!r}: {bad[0].reason} (flexrl.data.bad_record_policy is 'error')")
    good: list[Any] = [entry for entry in entries if not is_bad(entry)]
    return ProbedDataset(steps=steps, bad=bad, policy=policy, replacements=dict(report.replacements),
                         good=good, chooser=chooser, report=report)


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
                  progress: Callable[[int, int], None] | None = None, global_batch: int | None = None,
                  seed: int = 0, shuffle: bool = False) -> ProbedDataset:
    """Read, probe and apply the configured bad-record policy (`flexrl.data.bad_record_policy`)."""
    entries = probe_entries(path, preprocessor, progress)
    return apply_policy(entries, preprocessor.config.bad_record_policy, global_batch, seed, shuffle)
