"""MetaStore: where every prompt's cached slices live (controller side, no Ray import).

Keys:
- `PromptKey(step, slot)`: the prompt at position `slot` of step `step`. The same record may be
  drawn again in a later epoch; keying by (step, slot) keeps the two apart.
- `SampleId(step, slot, sample_index)`: one of the n GRPO samples of that prompt. All n samples
  share the prompt's single decode: they map to the same `PromptEntry`.
- `SliceKey(prompt, item_index, chunk_index)`: one cached object: an image, or a chunk of
  consecutive temporal patch groups of a video (see `ItemLayout`).

An entry records the owning actor, the reference of the preprocess task that returns
`{SliceKey: object ref}` (opaque here: a Ray ObjectRef in production, anything in tests) and a
generation number that grows each time the prompt is re-routed after its owner died.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from flexrl_ds.loader.routing import chunk_ranges, chunks_covering


@dataclass(frozen=True, order=True)
class PromptKey:
    step: int
    """Loader step the prompt belongs to."""
    slot: int
    """Position of the prompt within the step, 0..B-1."""

    def __str__(self) -> str:
        return f"s{self.step}p{self.slot}"


@dataclass(frozen=True, order=True)
class SampleId:
    step: int
    """Loader step."""
    slot: int
    """Prompt position within the step."""
    sample_index: int
    """Which of the prompt's n GRPO samples, 0..n-1."""

    @property
    def prompt(self) -> PromptKey:
        return PromptKey(self.step, self.slot)


@dataclass(frozen=True, order=True)
class SliceKey:
    prompt: PromptKey
    """Prompt the slice belongs to."""
    item_index: int
    """Media item index within the prompt (images and videos in prompt order)."""
    chunk_index: int
    """Chunk of temporal patch groups within the item (always 0 for an image)."""


@dataclass(frozen=True)
class ItemLayout:
    """How one media item's patch rows are cut into cached slices."""

    item_index: int
    """Media item index within the prompt."""
    kind: str
    """"image" or "video"."""
    grid_thw: tuple[int, int, int]
    """Predicted (temporal groups, patch rows, patch columns) of the item."""
    chunks: tuple[tuple[int, int], ...]
    """Temporal group ranges [start, end) of the cached slices, in order."""

    @property
    def rows_per_group(self) -> int:
        """Patch rows (of pixel_values) per temporal group: h * w."""
        return self.grid_thw[1] * self.grid_thw[2]

    @property
    def num_patches(self) -> int:
        return self.grid_thw[0] * self.rows_per_group

    def chunks_for(self, start: int, end: int) -> list[int]:
        return chunks_covering(self.chunks, start, end)


def make_layout(item_index: int, kind: str, grid_thw: tuple[int, int, int], groups_per_chunk: int) -> ItemLayout:
    """Layout of one item; images are a single slice whatever `groups_per_chunk` says."""
    grid = tuple(int(v) for v in grid_thw)
    per_chunk = grid[0] if kind == "image" else groups_per_chunk
    return ItemLayout(item_index, kind, grid, tuple(chunk_ranges(grid[0], per_chunk)))  # type: ignore[arg-type]


@dataclass
class PromptEntry:
    key: PromptKey
    """The prompt."""
    record_id: str
    """Dataset record id (for reports)."""
    layouts: tuple[ItemLayout, ...]
    """Slice layout per media item."""
    cost: float
    """Predicted preprocessing cost used for routing (total vision patches, at least 1)."""
    owner: str = ""
    """Name of the actor that holds (or is producing) the slices."""
    task_ref: Any = None
    """Reference to the preprocess task's result `{SliceKey: object ref}`."""
    generation: int = 0
    """Times this prompt was routed; > 1 means it was re-routed after an actor died."""

    def slice_keys(self) -> list[SliceKey]:
        return [
            SliceKey(self.key, layout.item_index, chunk)
            for layout in self.layouts
            for chunk in range(len(layout.chunks))
        ]


@dataclass
class MetaStore:
    """Prompt/sample → owner actor and slice references; the controller's only record of data."""

    num_samples_per_prompt: int = 1
    """GRPO group size n: samples 0..n-1 of a prompt share its entry."""
    _entries: dict[PromptKey, PromptEntry] = field(default_factory=dict)
    _by_owner: dict[str, set[PromptKey]] = field(default_factory=lambda: defaultdict(set))

    def add(self, entry: PromptEntry) -> None:
        assert entry.key not in self._entries, f"prompt {entry.key} registered twice"
        self._entries[entry.key] = entry

    def route(self, key: PromptKey, owner: str, task_ref: Any) -> PromptEntry:
        """Record that `owner` now produces `key`'s slices through task `task_ref`."""
        entry = self._entries[key]
        if entry.owner:
            self._by_owner[entry.owner].discard(key)
        entry.owner, entry.task_ref = owner, task_ref
        entry.generation += 1
        self._by_owner[owner].add(key)
        return entry

    def entry(self, key: PromptKey) -> PromptEntry:
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"prompt {key} is not in the MetaStore (released or never loaded)") from None

    def lookup(self, sample: SampleId) -> PromptEntry:
        """The entry a GRPO sample reads its pixels from."""
        if not 0 <= sample.sample_index < self.num_samples_per_prompt:
            raise KeyError(f"{sample}: sample_index outside 0..{self.num_samples_per_prompt - 1}")
        return self.entry(sample.prompt)

    def owner_of(self, sample: SampleId) -> str:
        return self.lookup(sample).owner

    def owned_by(self, owner: str) -> list[PromptKey]:
        return sorted(self._by_owner.get(owner, ()))

    def keys(self, step: int | None = None) -> list[PromptKey]:
        return sorted(k for k in self._entries if step is None or k.step == step)

    def remove(self, key: PromptKey) -> PromptEntry:
        """Forget one prompt (its decode failed); returns its entry."""
        entry = self.entry(key)
        del self._entries[key]
        self._by_owner[entry.owner].discard(key)
        return entry

    def release_step(self, step: int) -> dict[str, list[PromptKey]]:
        """Forget step `step`; returns, per owner, the prompts whose caches can be dropped."""
        released: dict[str, list[PromptKey]] = defaultdict(list)
        for key in self.keys(step):
            entry = self._entries.pop(key)
            self._by_owner[entry.owner].discard(key)
            released[entry.owner].append(key)
        return dict(released)

    def __len__(self) -> int:
        return len(self._entries)
