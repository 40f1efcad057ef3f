"""zero3.start_warmup: a DeepSpeed warm-up schedule's first optimizer step trains at the warm-up's start
(DeepSpeed's own WarmupCosineLR, stepped by hand as the engine steps it), not at 0; and
with_schedule_length's "auto"."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from deepspeed.runtime.lr_schedules import WarmupCosineLR

from flexrl_ds.models.zero3 import start_warmup, with_schedule_length


def optimizer_lrs(start: bool, steps: int = 6) -> list[float]:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.02)
    scheduler = WarmupCosineLR(optimizer, total_num_steps=steps, warmup_num_steps=2, warmup_type="linear",
                               warmup_min_ratio=0.1, cos_min_ratio=0.1)
    if start:
        start_warmup(SimpleNamespace(lr_scheduler=scheduler))
        start_warmup(SimpleNamespace(lr_scheduler=scheduler))  # only a fresh schedule is started
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])  # what the optimizer step uses
        scheduler.step()  # as the engine does after it
    return lrs


def test_the_first_step_trains_at_the_warmup_start():
    assert optimizer_lrs(start=False)[0] == 0.0  # DeepSpeed's own: nothing learnt in the first step
    lrs = optimizer_lrs(start=True)
    cosine = [0.1 + 0.9 * (1 + math.cos(math.pi * (k - 1) / 4)) / 2 for k in range(2, 6)]
    assert lrs == pytest.approx([0.02 * r for r in [0.1, 0.1 + 0.9 / 2] + cosine])
    start_warmup(SimpleNamespace(lr_scheduler=None))  # no schedule: nothing to do


def test_auto_schedule_length():
    config = {"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}}}
    assert with_schedule_length(config, 7)["scheduler"]["params"]["total_num_steps"] == 7
    assert with_schedule_length({"scheduler": {"params": {"total_num_steps": 3}}}, 7)["scheduler"]["params"] == \
        {"total_num_steps": 3}
