"""A pass too large for one plan under `max_tokens_per_rank`, cut into micro-batches. Pure.

Every rank holds at most `max_tokens_per_rank` tokens in one forward pass. When a pass's sequences
exceed that together (each alone fits: the trainer sets aside longer prompts before the rollout),
the pass runs as k micro-batches, one after the other: the no-grad passes simply concatenate their
log-probs, the update accumulates the gradients of all k and takes one optimizer step (the loss
denominators are the whole mini-batch's, so the gradient is the one of the uncut mini-batch).

`plan_micro_batches(shares, world_size, cost, sp)` takes one workload per SP domain (all domains
run every micro-batch together: ZeRO-3 gathers parameters over every rank) and returns, per
micro-batch, one `PlanResult` per domain. k is the fewest that plan: it starts at the tokens'
lower bound (the largest share ÷ (cap × ranks), rounded up) and grows by one while any domain's
part overflows (`StepOverflowError`). Each share is cut into k contiguous runs of balanced token
counts, so a prompt's samples, which sit together, mostly stay in one micro-batch (its media is
then encoded once per pass).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import CostModel
from flexrl_ds.planning.plan import Workload
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


def fewest_micro_batches(shares: Sequence[Workload], world_size: int, cap: int | None) -> int:
    """The tokens' lower bound on the number of micro-batches: every share within cap × ranks."""
    if cap is None:
        return 1
    return max(1, max(math.ceil(sum(s.tokens for s in share.sequences) / (cap * world_size)) for share in shares))


def plan_micro_batches(shares: Sequence[Workload], world_size: int, cost: CostModel, sp: SPConfig,
                       options: PlannerOptions | None = None) -> list[list[PlanResult]]:
    """Per micro-batch, one `PlanResult` per SP domain (module docstring). Raises `StepOverflowError`
    when some domain would need more micro-batches than it has sequences."""
    fewest_sequences = min(len(share.sequences) for share in shares)
    num = fewest_micro_batches(shares, world_size, sp.max_tokens_per_rank)
    last_error = None
    while num <= fewest_sequences:
        try:
            return _plan_cut(shares, num, world_size, cost, sp, options)
        except StepOverflowError as error:
            last_error, num = error, num + 1
    raise StepOverflowError(
        f"the pass cannot be cut into enough micro-batches under max_tokens_per_rank={sp.max_tokens_per_rank}: "
        f"an SP domain has only {fewest_sequences} sequences, fewer than the {num} or more micro-batches the "
        "pass needs (every domain runs every micro-batch)" + (f"; {last_error}" if last_error else "")) from None


def _plan_cut(shares: Sequence[Workload], num: int, world_size: int, cost: CostModel, sp: SPConfig,
              options: PlannerOptions | None) -> list[list[PlanResult]]:
    """Every share cut into `num` contiguous runs, each run planned; micro-batch j is every share's run j."""
    per_domain = []
    for share in shares:
        runs = contiguous_runs([s.tokens for s in share.sequences], num)
        per_domain.append([plan_step(Workload(share.sequences[run.start:run.stop]), world_size, cost, sp, options)
                           for run in runs])
    return [list(plans) for plans in zip(*per_domain)]
