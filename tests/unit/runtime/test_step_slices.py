"""StepSlices: a rank's pulled pixel slices, reused within a step and dropped at the next."""

from __future__ import annotations

import pytest

from flexrl_ds.loader.materializer import SliceRequest
from flexrl_ds.loader.metastore import PromptKey
from flexrl_ds.runtime.rank_pixels import StepSlices


def test_a_step_pulls_each_slice_once_and_the_next_step_starts_empty():
    a, b, c = (SliceRequest(PromptKey(3, slot), 0, 0, 2) for slot in range(3))
    slices = StepSlices()
    assert slices.missing(3, [a, b, a]) == [a, b]  # duplicates asked once
    slices.add(3, [a, b], ["A", "B"])
    assert slices.missing(3, [b, c, a]) == [c]
    slices.add(3, [c], ["C"])
    assert slices.tensors([c, a, b, a]) == ["C", "A", "B", "A"]
    assert slices.missing(4, [a]) == [a]  # another step: nothing held
    with pytest.raises(KeyError):
        slices.tensors([b])
    with pytest.raises(AssertionError):
        slices.add(3, [a], ["late"])  # slices of a finished step are not taken
