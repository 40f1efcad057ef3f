"""A rank's own pixels: pull exactly this rank's vision units from the preprocessing actors.

A rank encodes only its balanced share of the step's vision units (flexrl_ds/models/vision_balance.py:
an image, or one temporal patch group of a video); the tokens its packs hold need no pixels (their
embeddings arrive through the vision all-to-all). So the rank

1. computes its units from metadata alone (`flex_model.place_rank`: its layout and vision route,
   from the model's config; the same placement then builds its batch);
2. asks the run's `PixelSource` (runtime/data_controller.py) for one `SliceRequest` per run of
   consecutive units of an item (`unit_requests`): the service hands it references, its
   `Materializer` pulls the slices straight from the owning actors' object stores in the
   background (a slice whose actor died is repaired through the service: re-routed, or withdrawn);
3. after `build_step_batch`, swaps the placeholders of its units' items for `FetchedRows`
   (`fetched_items`): the fetched groups, addressable by row ranges like a full `pixel_values`
   tensor (what `vision_balance.unit_pixels` slices). Rows of groups not fetched cannot be read.

Identity: sequences are named by the caller (a sample name "s3p1k0" in the trainer, a record id in
`flexrl logprobs`); `prompt_keys` maps each to its prompt's `PromptKey` (where its pixels live).
Several sequences may share a prompt (the n GRPO samples): each gets the prompt's rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from flexrl_ds.loader.materializer import SliceRequest
from flexrl_ds.loader.metastore import PromptKey
from flexrl_ds.models.flex_model import place_rank


class FetchedRows:
    """An item's pixel rows of which only some temporal groups are present on this rank.

    Indexing with a row slice that covers whole groups of one fetched run returns those rows; any
    other access raises (it would mean the rank encodes a unit it did not fetch)."""

    def __init__(self, grid_thw: tuple[int, int, int], runs: Sequence[tuple[int, torch.Tensor]]):
        """runs: (first temporal group, rows of consecutive groups from there) per fetched run."""
        self.grid_thw = tuple(grid_thw)
        self.rows_per_group = self.grid_thw[1] * self.grid_thw[2]
        self.runs = sorted(runs, key=lambda run: run[0])
        for start, rows in self.runs:
            assert rows.shape[0] % self.rows_per_group == 0 and start >= 0, (start, tuple(rows.shape))

    @property
    def shape(self) -> tuple[int, int]:
        """Shape of the whole item's `pixel_values` (most of which is not here)."""
        return (self.grid_thw[0] * self.rows_per_group, self.runs[0][1].shape[1])

    def __getitem__(self, index: slice) -> torch.Tensor:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"FetchedRows supports row slices only, got {index!r}")
        first, stop = index.start or 0, index.stop
        for start, rows in self.runs:
            lo = start * self.rows_per_group
            if lo <= first and stop <= lo + rows.shape[0]:
                return rows[first - lo:stop - lo]
        raise KeyError(f"rows [{first}, {stop}) of an item with grid {self.grid_thw} were not fetched by this "
                       f"rank (fetched groups: {[(s, s + r.shape[0] // self.rows_per_group) for s, r in self.runs]})")


def rank_units(model_config, plan, samples: Mapping[str, Any], rank: int) -> tuple[Any, ...]:
    """The vision units `rank` encodes in this step (same as `build_step_batch(...).route.my_units`),
    from the HF config alone (no weights). A rank that also builds its batch should call
    `flex_model.place_rank` once and pass the placement to `build_step_batch` instead."""
    return place_rank(model_config, plan, samples, rank).units


def unit_requests(units: Sequence[Any], prompt_keys: Mapping[str, Any]) -> list[Any]:
    """One `SliceRequest` per run of consecutive temporal groups of one item among `units`."""
    groups: dict[tuple[str, int], list[int]] = {}
    for unit in units:
        groups.setdefault((unit.seq_id, unit.item_index), []).append(unit.t_index)
    requests = []
    for (seq_id, item_index), t_indices in groups.items():
        t_indices = sorted(set(t_indices))
        start = previous = t_indices[0]
        for t in t_indices[1:] + [None]:
            if t is not None and t == previous + 1:
                previous = t
                continue
            requests.append(SliceRequest(prompt_keys[seq_id], item_index, start, previous + 1))
            if t is not None:
                start = previous = t
    return requests


def fetched_items(samples: Mapping[str, Any], prompt_keys: Mapping[str, PromptKey],
                  requests: Sequence[SliceRequest], tensors: Sequence[Any]) -> dict[str, list[Any]]:
    """Sequence id -> its VisionItems, where the items that `requests` fetched (`tensors[i]` for
    `requests[i]`) carry `FetchedRows`; every sequence of a request's prompt gets its rows."""
    sequences: dict[PromptKey, list[str]] = {}
    for seq_id, key in prompt_keys.items():
        if seq_id in samples:
            sequences.setdefault(key, []).append(seq_id)
    runs: dict[tuple[str, int], list[tuple[int, torch.Tensor]]] = {}
    for request, fetched in zip(requests, tensors):
        for seq_id in sequences.get(request.prompt, ()):
            runs.setdefault((seq_id, request.item_index), []).append(
                (request.t_start, fetched["pixel_values"].float()))
    items = {seq_id: list(sample.items) for seq_id, sample in samples.items()}
    for (seq_id, item_index), item_runs in runs.items():
        item = items[seq_id][item_index]
        items[seq_id][item_index] = dataclasses.replace(item, pixel_values=FetchedRows(item.grid_thw, item_runs))
    return items


class StepSlices:
    """The slices this rank pulled in its current step, kept until another step's pass comes: the
    step's later passes (the reference's log-probs, the update) reuse them instead of pulling the
    same pixels again. Exact requests are reused; others are pulled."""

    def __init__(self):
        self.step: int | None = None
        self._tensors: dict[SliceRequest, Any] = {}

    def missing(self, step: int, requests: Sequence[SliceRequest]) -> list[SliceRequest]:
        """The requests of `step` not held (a new step first drops the last step's slices)."""
        if step != self.step:
            self.step, self._tensors = step, {}
        return [request for request in dict.fromkeys(requests) if request not in self._tensors]

    def add(self, step: int, requests: Sequence[SliceRequest], tensors: Sequence[Any]) -> None:
        assert step == self.step, (step, self.step)
        self._tensors.update(zip(requests, tensors))

    def tensors(self, requests: Sequence[SliceRequest]) -> list[Any]:
        """The held slices of `requests`, in order (all must be held)."""
        return [self._tensors[request] for request in requests]


class RankPixels:
    """This rank's pixel pull for one step: started before its batch is built, read after."""

    def __init__(self, pixels: Any, step: int, prompt_keys: Mapping[str, PromptKey], units: Sequence[Any]):
        """pixels: the run's `PixelSource`; prompt_keys: sequence id -> its prompt's key."""
        self.step, self.prompt_keys, self.units = step, dict(prompt_keys), tuple(units)
        self.requests = unit_requests(self.units, self.prompt_keys)
        self.materializer = pixels.start(step, self.requests)
        self.stats: dict[str, float] = {}

    def items(self, samples: Mapping[str, Any], units: Sequence[Any]) -> dict[str, list[Any]]:
        """seq id -> VisionItems where the items of this rank's units carry `FetchedRows`."""
        assert tuple(units) == self.units, "the batch's vision route differs from the one prefetched"
        fetched = self.materializer.get(self.step)
        if fetched.withdrawn:
            raise ValueError(
                f"step {self.step}: prompt(s) withdrawn after hand-out (decode failed): "
                + "; ".join(f"record {record_id!r}: {reason}"
                            for record_id, reason in fetched.withdrawn_reasons().items())
                + ". `flexrl logprobs` cannot drop a prompt from a step whose plan is fixed: "
                  "fix or remove the record and run again")
        self.stats = {"pixel_bytes": float(fetched.bytes_fetched), "cross_node_bytes": float(fetched.bytes_cross_node),
                      "wait_s": fetched.wait_s,
                      "num_requests": float(len(self.requests)), "num_repairs": float(fetched.num_repairs)}
        return fetched_items(samples, self.prompt_keys, self.requests, fetched.tensors)

    def close(self) -> None:
        self.materializer.close()
