"""The one bad-record policy of the data layer (training loader and offline tools alike).

Pure: no Ray, no torch. Setting: `flexrl.data.bad_record_policy` (`MediaConfig`), passed to the
training loader as its `bad_record_policy` argument. A bad record is a `BadRecord(id, reason,
index, stage)`: found while reading (stage read), probing metadata (probe) or decoding pixels
(materialize).

Order. Rows are visited per epoch in an `EpochOrder`: a permutation seeded by (seed, epoch), or
file order without shuffling. A step takes the next `global_batch` positions from the *head*
(its window); an epoch ends when fewer than `global_batch` unused positions remain.

Policies, applied per step to the window's bad rows in slot order and, before the step is handed
out, to any sample of the step whose decode fails:
- `skip`: the bad row's slot is dropped; the step trains on fewer prompts.
- `replace`: the slot is filled by the row *reserved from the tail* of the order's epoch (the
  last position not yet used, walking backwards, skipping rows the step already drew; when
  look-ahead has already started the next epoch, that epoch's tail). A reserved row that is itself
  bad is reported too and the next one is reserved. The substitute keeps its metadata under the sample id
  `<bad id>-><substitute id>`, and `replacements[bad id] = substitute id`. Reserved rows leave the
  epoch (the head never reaches them), so every other step keeps exactly its window, and no record
  appears twice in a step (nor twice in an epoch). If the epoch has no unused row left, the slot
  is dropped as under `skip` and the record is counted in `num_unreplaced`.
  A substitute that fails to decode is replaced in turn: `replacements[bad id]` then names the
  newest substitute, and the failed substitute is reported as a bad record of its own.
- `error`: `ValueError` naming the step, the record id and the reason.
Decode failures are settled before a step is handed out (`ProxyLoader.next_step` waits for every
decode), so the rules above apply to them in their slot. The one exception is a failure found
*after* hand-out (the owning actor died, the prompt was re-decoded elsewhere and that decode
failed): the step's shapes are already planned, so no substitute can take the slot. Under skip and
replace the sample is *withdrawn* (`StepReport.withdrawn[sample id] = reason`, `num_withdrawn`), so
the step's report still names exactly what it trains on; under `error` it raises.
Reporting: every bad record met (window, reserved tail rows, decode failures) goes into the
step's `StepReport.bad_records` with its reason and stage, and into `BadRecordCounts` (`num_bad`,
`num_replaced`, `num_skipped`, `num_unreplaced`, `num_withdrawn`); a step's report always names
exactly the samples it trains on (its samples minus the withdrawn ones).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from flexrl_ds.media.config import BAD_RECORD_POLICIES

Entry = Any
"""A probed row: a `SampleMeta` (trainable) or a `BadRecord`."""


def is_bad(entry: Entry) -> bool:
    """True for a `BadRecord` (has a reason, no media items), False for a `SampleMeta`."""
    return hasattr(entry, "reason") and not hasattr(entry, "items")


def check_policy(policy: str, where: str = "flexrl.data.bad_record_policy") -> str:
    """`policy` if it is one of skip, replace, error; else ValueError naming `where`."""
    if policy not in BAD_RECORD_POLICIES:
        raise ValueError(f"{where}: {policy!r} is not one of {', '.join(BAD_RECORD_POLICIES)}")
    return policy


def original_id(sample_id: str) -> str:
    """The id of the bad record whose slot a sample fills (`a->b` -> `a`), else the id itself."""
    return sample_id.split("->")[0]


class EpochOrder:
    """Seeded per-epoch permutation of row numbers: windows from the head, substitutes from the tail."""

    def __init__(self, num_records: int, seed: int = 0, shuffle: bool = True):
        if num_records < 1:
            raise ValueError("the dataset has no rows")
        self.num_records, self.seed, self.shuffle = num_records, seed, shuffle
        self.epoch = -1
        self._start_epoch()

    def _start_epoch(self) -> None:
        self.epoch += 1
        self._order = list(range(self.num_records))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + self.epoch).shuffle(self._order)
        self._head, self._tail = 0, self.num_records

    @property
    def num_unused(self) -> int:
        """Positions of this epoch neither taken by a window nor reserved."""
        return self._tail - self._head

    def take(self, count: int) -> list[int]:
        """The next `count` rows (a new epoch starts when fewer remain)."""
        if count > self.num_records:
            raise ValueError(f"global batch {count} exceeds the dataset's {self.num_records} rows")
        if self._tail - self._head < count:
            self._start_epoch()
        window = self._order[self._head : self._head + count]
        self._head += count
        return window

    def reserve(self, exclude: Collection[int] = ()) -> int | None:
        """The last unused row of the epoch not in `exclude`, for a substitute; None when there is
        none. Skipped rows stay unused (a later window still visits them)."""
        for position in range(self._tail - 1, self._head - 1, -1):
            row = self._order[position]
            if row not in exclude:
                del self._order[position]
                self._order.insert(self._tail - 1, row)  # the skipped rows shift down, stay unused
                self._tail -= 1
                return row
        return None


@dataclass
class BadRecordCounts:
    """Running totals over all steps (what `LoaderStats` reports)."""

    num_bad: int = 0
    """Bad records met (window rows, reserved tail rows, decode failures)."""
    num_replaced: int = 0
    """Slots filled by a substitute."""
    num_skipped: int = 0
    """Slots dropped under policy skip."""
    num_unreplaced: int = 0
    """Slots dropped under policy replace because the epoch had no unused row left."""
    num_withdrawn: int = 0
    """Samples withdrawn from a step already handed out (decode failed after hand-out)."""


@dataclass
class StepReport:
    """What a step's bad records did: every bad record, and who stands in for whom."""

    bad_records: list[Any] = field(default_factory=list)
    """Every `BadRecord` met while composing or settling the step, in the order met."""
    replacements: dict[str, str] = field(default_factory=dict)
    """Bad record id -> id of the record standing in for it (policy replace)."""
    withdrawn: dict[str, str] = field(default_factory=dict)
    """Sample id -> reason, for samples withdrawn after the step was handed out."""
    rows: list[int] = field(default_factory=list)
    """Dataset rows the step drew: its window, then every reserved row (never reserved twice)."""
    fates: list[str] = field(default_factory=list)
    """What became of each bad record and its slot, aligned with `bad_records` (FATE_*)."""

    def add(self, bad: Any, fate: str) -> int:
        """Record a bad record and its fate; returns its position (to settle the fate later)."""
        self.bad_records.append(bad)
        self.fates.append(fate)
        return len(self.fates) - 1


FATE_SKIPPED = "skipped: the step trains on fewer prompts"
FATE_NO_SUBSTITUTE = "skipped: no unused record was left to stand in"
FATE_BAD_SUBSTITUTE = "drawn to stand in for another bad record, not used"
FATE_WITHDRAWN = "withdrawn after the step was handed out: not trained on"


def fate_replaced(substitute_id: str) -> str:
    return f"record {substitute_id!r} stands in"


class BadRecordPolicy:
    """Applies one policy, drawing substitutes from an `EpochOrder`'s tail; counts everything.

    `probe(rows)` turns row numbers into entries (`SampleMeta` or `BadRecord`), in order: the
    training loader probes on its actors, the offline path looks up rows probed beforehand.
    """

    def __init__(self, policy: str, order: EpochOrder, probe: Callable[[list[int]], list[Entry]]):
        self.policy = check_policy(policy)
        self.order, self._probe = order, probe
        self.counts = BadRecordCounts()

    def compose(self, step: int, global_batch: int) -> tuple[int, list[Entry], StepReport]:
        """(epoch, samples in slot order, report) of the next window under the policy."""
        window = self.order.take(global_batch)
        epoch, report, samples = self.order.epoch, StepReport(rows=list(window)), []
        for entry in self._probe(window):
            sample = self.resolve(step, entry, report) if is_bad(entry) else entry
            if sample is not None:
                samples.append(sample)
        return epoch, samples, report

    def resolve(self, step: int, bad: Any, report: StepReport, failed_id: str | None = None) -> Entry | None:
        """Record `bad` in `report` and apply the policy to its slot: the substitute (renamed
        `<original>-><substitute>`) or None (slot dropped); ValueError under `error`.
        `failed_id`: the sample id of the slot when a sample fails after composition (decode)."""
        original = original_id(failed_id if failed_id is not None else bad.id)
        position = report.add(bad, FATE_SKIPPED)
        report.replacements.pop(original, None)
        self.counts.num_bad += 1
        if self.policy == "error":
            raise ValueError(f"step {step}: record {bad.id!r}: {bad.reason} "
                             f"(flexrl.data.bad_record_policy is 'error')")
        if self.policy == "skip":
            self.counts.num_skipped += 1
            return None
        substitute = self._draw(report)
        if substitute is None:
            report.fates[position] = FATE_NO_SUBSTITUTE
            self.counts.num_unreplaced += 1
            return None
        report.fates[position] = fate_replaced(substitute.id)
        report.replacements[original] = substitute.id
        self.counts.num_replaced += 1
        return replace(substitute, id=f"{original}->{substitute.id}")

    def withdraw(self, step: int, bad: Any, report: StepReport, failed_id: str) -> None:
        """A sample of a step already handed out failed to decode: record and count it; under
        `error` raise; else the sample `failed_id` is withdrawn (no substitute under either skip
        or replace: the step's shapes are already planned, a substitute would not fit its slot)."""
        report.add(bad, FATE_WITHDRAWN)
        self.counts.num_bad += 1
        if self.policy == "error":
            raise ValueError(f"step {step}: record {bad.id!r}: {bad.reason} "
                             f"(flexrl.data.bad_record_policy is 'error')")
        report.withdrawn[failed_id] = bad.reason
        self.counts.num_withdrawn += 1

    def _draw(self, report: StepReport) -> Entry | None:
        while (row := self.order.reserve(exclude=set(report.rows))) is not None:
            report.rows.append(row)
            (entry,) = self._probe([row])
            if not is_bad(entry):
                return entry
            report.add(entry, FATE_BAD_SUBSTITUTE)
            self.counts.num_bad += 1
        return None


def select_steps(entries: Sequence[Entry], policy: str, global_batch: int | None = None,
                 seed: int = 0, shuffle: bool = False) -> tuple[list[list[Entry]], StepReport, BadRecordPolicy]:
    """Offline: the steps (sample lists) the training loader would compose from rows probed
    beforehand, one epoch, and one report for all of them. `global_batch` None: one step of all
    rows (then `replace` has no unused row to draw from)."""
    if not entries:
        raise ValueError("the dataset has no rows")
    global_batch = global_batch or len(entries)
    order = EpochOrder(len(entries), seed=seed, shuffle=shuffle)
    chooser = BadRecordPolicy(policy, order, lambda rows: [entries[row] for row in rows])
    steps: list[Any] = []
    report = StepReport()
    while order.num_unused >= global_batch:
        _, samples, step_report = chooser.compose(len(steps), global_batch)
        steps.append(samples)
        report.bad_records += step_report.bad_records
        report.fates += step_report.fates
        report.replacements.update(step_report.replacements)
        report.rows += step_report.rows
    return steps, report, chooser
