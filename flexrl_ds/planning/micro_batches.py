"""A pass too large for one plan under `max_tokens_per_rank`, cut into micro-batches. Pure.

Every rank holds at most `max_tokens_per_rank` tokens in one forward pass. When a pass's sequences
exceed that together (each alone fits: the trainer sets aside longer prompts before the rollout),
the pass runs as k micro-batches, one after the other: the no-grad passes simply concatenate their
log-probs, the update accumulates the gradients of all k and takes one optimizer step (the loss
denominators are the whole mini-batch's, so the gradient is the one of the uncut mini-batch).

`plan_micro_batches(shares, world_size, cost, sp)` takes one workload per SP domain (all domains
run every micro-batch together: ZeRO-3 gathers parameters over every rank) and returns, per
micro-batch, one `PlanResult` per domain. Each domain's sequences, in their order (a prompt's
samples sit together, so its media is mostly encoded once per pass), are filled greedily into
contiguous runs: a run takes the next sequence while the run stays within cap × ranks and plans
(`StepOverflowError` otherwise): the fewest contiguous runs, where every part of a run that plans
plans too. k is the largest number of runs over the domains. Each domain then takes k runs of
balanced tokens where all of them plan (no small last micro-batch paying a whole pass's fixed
costs), else its greedy runs with the largest split in two until there are k. A domain with fewer
sequences than k runs one sequence per micro-batch and idles in the rest (an empty plan: its ranks
run every module once on a placeholder token, as ZeRO-3's collective gathers need, and add nothing
to the loss). Without a cap a pass is one micro-batch, `plan_step`'s plan.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import CostModel
from flexrl_ds.planning.plan import SequenceSpec, Workload
from flexrl_ds.planning.planner import PlannerOptions, PlanResult, StepOverflowError, plan_step


def contiguous_runs(tokens: Sequence[int], num_runs: int) -> list[range]:
    """`num_runs` non-empty runs of consecutive indices covering `tokens`, each cut at the sequence
    boundary nearest to j/num_runs of the running total (the runs' totals then differ by about one
    sequence at most)."""
    if not 1 <= num_runs <= len(tokens):
        raise ValueError(f"cannot cut {len(tokens)} sequences into {num_runs} non-empty runs")
    ends = np.concatenate([[0.0], np.cumsum(np.asarray(tokens, dtype=float))])  # ends[i]: total of the first i
    cuts = [0]
    for j in range(1, num_runs):
        target = ends[-1] * j / num_runs
        after = int(np.searchsorted(ends, target, side="left"))  # first boundary at or past the target
        cut = after if ends[after] - target <= target - ends[after - 1] else after - 1
        cuts.append(min(max(cut, cuts[-1] + 1), len(tokens) - (num_runs - j)))
    cuts.append(len(tokens))
    return [range(lo, hi) for lo, hi in zip(cuts, cuts[1:])]


def plan_micro_batches(shares: Sequence[Workload], world_size: int, cost: CostModel, sp: SPConfig,
                       options: PlannerOptions | None = None) -> list[list[PlanResult]]:
    """Per micro-batch, one `PlanResult` per SP domain (module docstring)."""
    def plan(sequences: tuple[SequenceSpec, ...]) -> PlanResult:
        return plan_step(Workload(sequences), world_size, cost, sp, options)

    budget = sp.max_tokens_per_rank * world_size if sp.max_tokens_per_rank is not None else math.inf
    per_domain = [greedy_runs(share.sequences, budget, plan) for share in shares]
    num_micro_batches = max(1, max(len(runs) for runs in per_domain))
    planned = [balanced_runs(share.sequences, num_micro_batches, plan) or split_runs(runs, num_micro_batches, plan)
               for share, runs in zip(shares, per_domain)]
    return [list(results) for results in zip(*planned)]


Run = tuple[tuple[SequenceSpec, ...], "PlanResult | None"]
"""A micro-batch's sequences of one domain, and their plan (None: not planned yet)."""


def greedy_runs(sequences: Sequence[SequenceSpec], budget: float, plan: Callable) -> list[Run]:
    """The fewest contiguous runs, in order, each taking the next sequence while its tokens stay
    within `budget` and `plan` does not raise `StepOverflowError` (a sequence alone always plans:
    longer prompts are set aside before the rollout)."""
    runs: list[Run] = []
    start = 0
    while start < len(sequences):
        stop, total = start, 0
        while stop < len(sequences) and (stop == start or total + sequences[stop].tokens <= budget):
            total, stop = total + sequences[stop].tokens, stop + 1
        while True:
            try:
                result = plan(tuple(sequences[start:stop]))
                break
            except StepOverflowError:
                if stop - start == 1:
                    raise
                stop -= 1
        runs.append((tuple(sequences[start:stop]), result))
        start = stop
    return runs


def balanced_runs(sequences: Sequence[SequenceSpec], num_runs: int, plan: Callable) -> list[PlanResult] | None:
    """The plans of `num_runs` contiguous runs of balanced tokens (`contiguous_runs`); None when
    one of them overflows, when there is one run (the greedy run is that plan already) or when
    there are fewer sequences than runs."""
    if num_runs == 1 or num_runs > len(sequences):
        return None
    try:
        return [plan(tuple(sequences[run.start:run.stop]))
                for run in contiguous_runs([s.tokens for s in sequences], num_runs)]
    except StepOverflowError:
        return None


def split_runs(runs: list[Run], num_runs: int, plan: Callable) -> list[PlanResult]:
    """`runs` made `num_runs` by cutting the one with the most tokens (of those with two sequences
    or more) into two balanced halves, again and again; once every run holds one sequence, empty
    runs (the domain idles) fill the rest. The plan of each run."""
    runs = list(runs)
    while len(runs) < num_runs:
        splittable = [i for i, (seqs, _) in enumerate(runs) if len(seqs) > 1]
        if not splittable:
            runs += [((), None)] * (num_runs - len(runs))
            break
        index = max(splittable, key=lambda i: sum(s.tokens for s in runs[i][0]))
        seqs = runs[index][0]
        halves = contiguous_runs([s.tokens for s in seqs], 2)
        runs[index:index + 1] = [(seqs[half.start:half.stop], None) for half in halves]
    return [result if result is not None else plan(seqs) for seqs, result in runs]
