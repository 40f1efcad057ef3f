"""Each step's floor (models/step_floor.py) beside its measured phases: `floor_s` and `floor_ratio`
in metrics.jsonl (docs/OUTPUTS.md), a factor on the console line."""

from __future__ import annotations

import math
from typing import Any

from flexrl_ds.models.flops import encoded_grids, vision_flops
from flexrl_ds.models.step_floor import DevicePeaks, PromptTokens, step_floor, vision_params


def job_gpus(run: Any, num_ranks: int) -> int:
    """The GPUs the step's phases can spread over: the policy ranks', and the rollout engines' where
    they are not colocated (at least one)."""
    trainer, rollout = run.flexrl.trainer, run.flexrl.rollout
    gpus = num_ranks * trainer.num_gpus_per_rank
    if not trainer.colocate:
        gpus += rollout.num_engines * rollout.num_gpus_per_engine
    return max(1, math.ceil(gpus - 1e-9))


def step_prompts(samples: Any, encoded: dict[str, Any], vision: Any) -> list[PromptTokens]:
    """The floor's view of the step: per prompt that got responses, its tokens, its samples' response
    tokens and its media's vision-tower FLOPs (its first sample's items, shared by all)."""
    prompts = []
    for prompt in samples.prompts:
        names = [name for name in prompt.sample_names if name in samples.response_ids]
        if not names:
            continue
        media = 0.0
        if vision is not None and names[0] in encoded:
            media = vision_flops(vision, encoded_grids([(names[0], encoded[names[0]])]))
        prompts.append(PromptTokens(len(prompt.prompt_ids), tuple(len(samples.response_ids[n]) for n in names), media))
    return prompts


def floor_metrics(options: Any, samples: Any, encoded: dict[str, Any], times: dict[str, float],
                  logprob_passes: int) -> dict[str, Any]:
    """{"floor_s": phase -> seconds (and "step"), "floor_ratio": phase -> measured ÷ floor}; {} where
    the GPU's peaks or the model's shape are unknown (CPU runs). `options`: the driver's TrainOptions
    (decoder, vision, peak_flops, peak_bytes_per_s, floor_gpus)."""
    if not options.peak_flops or not options.peak_bytes_per_s or options.decoder is None:
        return {}
    floor = step_floor(options.decoder, step_prompts(samples, encoded, options.vision),
                       DevicePeaks(options.peak_flops, options.peak_bytes_per_s), options.floor_gpus, logprob_passes,
                       vision_params(options.vision) if options.vision is not None else 0)
    seconds = floor.phases()
    ratio = {phase: times[phase] / value for phase, value in seconds.items() if value > 0 and phase in times}
    return {"floor_s": seconds, "floor_ratio": ratio}


def floor_text(metrics: dict[str, Any]) -> str:
    """The console line's part: ` | floor ×R (rollout ×a, inference ×b, update ×c)`; "" without one."""
    ratio = metrics.get("floor_ratio")
    if not ratio or "step" not in ratio:
        return ""
    parts = ", ".join(f"{phase} ×{ratio[phase]:.1f}" for phase in ("rollout", "inference", "update") if phase in ratio)
    return f" | floor ×{ratio['step']:.1f} ({parts})"
