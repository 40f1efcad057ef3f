"""The figures a step's metrics derive from its samples and plans (trainer/driver.py): model FLOPs
utilisation per phase, sequences per degree, the plans as a `PassJob` carries them, and the step's
bad records said one line each."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from flexrl_ds.common import RunInputError
from flexrl_ds.models.flops import VisionShape, encoded_grids, training_forward_flops, vision_flops

if TYPE_CHECKING:
    from flexrl_ds.trainer.driver import TrainOptions
    from flexrl_ds.trainer.samples import StepSamples

logger = logging.getLogger(__package__)


def step_mfu(options: TrainOptions, samples: StepSamples, lengths: list[int], times: dict[str, float],
             passes: int, vision_forward: float = 0.0) -> dict[str, Any]:
    """{"mfu": {"update": ..., "inference": ...}}: the model FLOPs of the phase (models/flops.py:
    forward and backward of every sample in the update; `passes` forwards, old policy and
    reference, in the inference), the vision tower's `vision_forward` included likewise,
    ÷ (its seconds × ranks × the GPU's bf16 peak); {} without a peak."""
    if not options.peak_flops or options.decoder is None:
        return {}
    prompt_of = samples.prompt_of()
    forward = vision_forward + sum(training_forward_flops(options.decoder, len(prompt_of[name].prompt_ids) + length)
                                   for name, length in zip(samples.names, lengths))
    capacity = options.num_ranks * options.peak_flops
    return {"mfu": {"update": 3 * forward / (capacity * max(times["update"], 1e-9)),
                    "inference": passes * forward / (capacity * max(times["inference"], 1e-9))}}


def vision_forward_flops(vision: VisionShape | None, micro_batches, encoded: dict[str, Any]) -> float:
    """The vision tower's forward FLOPs in the log-prob pass: each micro-batch's SP domains encode
    the media of their sequences, a prompt's shared items once (models/vision_balance.py)."""
    if vision is None:
        return 0.0
    return sum(vision_flops(vision, encoded_grids((name, encoded[name]) for pack in result.plan.packs
                                                  for name in pack.sequences))
               for results in micro_batches for result in results)


def plans_json(micro_batches) -> list[list[dict]]:
    """`PassJob.plans_json`: per micro-batch, every SP domain's plan."""
    return [[result.plan.to_json() for result in results] for results in micro_batches]


def degrees(results) -> dict[str, int]:
    """Sequences per degree over every SP domain's plan."""
    total: dict[int, int] = {}
    for result in results:
        for degree, count in result.metrics.degree_histogram.items():
            total[degree] = total.get(degree, 0) + count
    return {str(k): v for k, v in sorted(total.items())}


def report_bad_records(step: int, report: dict[str, Any], trained_on: int) -> int:
    """Say what the step's bad records did (`LoaderStep.report`: one line each, with its reason and
    its fate, media/bad_records.py FATE_*); raise when no prompt of the step is left. Returns their number."""
    bad = report.get("bad_records", [])
    for record in bad:
        logger.info(f"data: step {step}: bad record {record['id']!r} ({record['stage']}): {record['reason']}; "
                    f"{record['fate']}")
    if not trained_on:
        reasons = "; ".join(f"{r['id']!r}: {r['reason']}" for r in bad[:5]) + (" ..." if len(bad) > 5 else "")
        raise RunInputError(f"step {step}: every record drawn for it was bad ({reasons}); "
                           "`flexrl inspect-data` checks the whole dataset")
    return len(bad)


INFERENCE_PARTS = ("plan", "old", "reference", "batches", "forward")
"""Keys of `inference_time_s`: the driver's planning of the log-prob passes, the old-policy pass and
the reference pass (only with a KL term) as the driver waited for them, and the two passes' batch
building (the pixel pulls included) and forwards (each to its log-probs on the host), each pass's
from its slowest rank."""
