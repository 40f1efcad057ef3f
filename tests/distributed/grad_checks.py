"""Comparisons of a ZeRO-3 run's gradients against a plain single-process reference."""

from __future__ import annotations


def worst_relative_grad_diff(grads: dict, ref_grads: dict) -> float:
    """The largest over parameters of max |grad - ref| / max |ref| (the reference's scale floored at
    1e-6), after checking that both name the same parameters."""
    assert set(grads) == set(ref_grads)
    return max(((grads[n] - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp(min=1e-6)).item()
               for n in ref_grads)
