"""Reward shaping beside the reward function: DAPO's overlong penalty and the adaptive KL coefficient.

- `overlong_penalty` (DAPO, arXiv 2503.14476, "soft overlong punishment"): with L_max =
  flexrl.rollout.max_response_length and a buffer B = flexrl.rl.overlong_buffer_length, a response
  of l tokens gets
      0                                   if l <= L_max - B
      -factor * (l - (L_max - B)) / B     if L_max - B < l <= L_max
  added to its reward before the advantages, so -factor at L_max (where the rollout cuts it).
- `AdaptiveKLController` (Ziegler et al. 2019, OpenRLHF's --kl_target / --kl_horizon): after each
  step, coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * samples / horizon, kl being the step's
  measured KL (here: the mean k1 per response token of old policy vs reference).
"""

from __future__ import annotations

from dataclasses import dataclass


def overlong_penalty(length: int, max_length: int, buffer_length: int, factor: float) -> float:
    """The penalty (<= 0) of a response of `length` tokens (module docstring); 0 with buffer_length 0."""
    if buffer_length <= 0:
        return 0.0
    if buffer_length > max_length:
        raise ValueError(f"flexrl.rl.overlong_buffer_length: {buffer_length} is more than "
                         f"flexrl.rollout.max_response_length {max_length}")
    expected = max_length - buffer_length
    return -factor * min(max(length - expected, 0), buffer_length) / buffer_length


@dataclass
class AdaptiveKLController:
    """The KL coefficient of a run, adapted towards `target` (module docstring)."""

    coef: float
    """The current coefficient (starts at flexrl.rl.init_kl_coef)."""
    target: float
    horizon: int

    def update(self, measured_kl: float, num_samples: int) -> float:
        """Adapt to one step's KL over `num_samples` samples; returns the new coefficient."""
        error = min(max(measured_kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + error * num_samples / self.horizon
        return self.coef
