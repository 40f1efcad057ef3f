"""`flexrl bench planner`: planning time and plan quality over sequence counts × world sizes.

Timing: median wall time of `plan_step` (after one warm-up call) on generated steps, next to the
time of the veRL-style Karmarkar–Karp bucketing measured in the same run as the baseline.
Quality: FlexUlysses efficiency / balance / all-to-all per mix × world size × sequence count, with
the worst case over seeds (the targets are worst-case targets).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from flexrl_ds.bench.workloads import MIXES, make_workload
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.baselines import verl_bucketing
from flexrl_ds.planning.cost_model import CostModel
from flexrl_ds.planning.planner import PlannerOptions, plan_step

SEQUENCE_COUNTS = (64, 128, 256, 512, 1024, 2048)
WORLD_SIZES = (8, 16, 32, 64, 128)


@dataclass
class PlannerBench:
    """Results of one benchmark run."""

    timing: list[dict[str, Any]] = field(default_factory=list)
    """Rows: mix, num_sequences, world_size, plan_ms / plan_cpu_ms / verl_ms (medians)."""
    quality: list[dict[str, Any]] = field(default_factory=list)
    """Rows: mix, world_size, num_sequences, worst efficiency/balances, mean a2a relative, worst
    modelled step time (with a calibration)."""

    def to_json(self) -> dict[str, Any]:
        return {"timing": self.timing, "quality": self.quality}


def _median_ms(run, repeats: int) -> tuple[float, float]:
    """(median wall ms, median CPU ms of this process) over `repeats` runs after one warm-up.

    CPU time is reported too because the benchmark machine may be shared: wall time then includes
    waiting for a core, CPU time does not.
    """
    run()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        run()
        wall.append((time.perf_counter() - start) * 1000)
        cpu.append((time.process_time() - start_cpu) * 1000)
    return statistics.median(wall), statistics.median(cpu)


def time_planner(cost: CostModel, sp: SPConfig, mix: str, repeats: int, counts=SEQUENCE_COUNTS,
                 world_sizes=WORLD_SIZES, progress=None, options: PlannerOptions | None = None) -> list[dict[str, Any]]:
    rows = []
    for num in counts:
        workload = make_workload(mix, num, seed=0)
        for world_size in world_sizes:
            plan_wall, plan_cpu = _median_ms(lambda: plan_step(workload, world_size, cost, sp, options), repeats)
            verl_wall, _ = _median_ms(lambda: verl_bucketing(workload, world_size, cost, sp.p_max), repeats)
            rows.append({"mix": mix, "num_sequences": num, "world_size": world_size, "plan_ms": plan_wall,
                         "plan_cpu_ms": plan_cpu, "verl_ms": verl_wall})
            if progress is not None:
                progress(rows[-1])
    return rows


def measure_quality(cost: CostModel, sp: SPConfig, seeds: int, counts=SEQUENCE_COUNTS, world_sizes=WORLD_SIZES,
                    mixes=tuple(MIXES), progress=None, options: PlannerOptions | None = None) -> list[dict[str, Any]]:
    rows = []
    for mix in mixes:
        for world_size in world_sizes:
            for num in counts:
                results = [plan_step(make_workload(mix, num, seed), world_size, cost, sp, options)
                           for seed in range(seeds)]
                metrics = [r.metrics for r in results]
                rows.append({
                    "mix": mix, "world_size": world_size, "num_sequences": num,
                    "efficiency_min": min(m.efficiency for m in metrics),
                    "efficiency_bound_min": min(m.efficiency_bound for m in metrics),
                    "attention_balance_bound_max": max(m.attention_balance_bound for m in metrics),
                    "cost_balance_max": max(m.cost_balance for m in metrics),
                    "attention_balance_max": max(m.attention_balance for m in metrics),
                    "lb_is_longest": any(m.lower_bound * world_size > sum(m.rank_cost) * 1.0001 for m in metrics),
                    "all_to_all_relative_mean": statistics.fmean(m.all_to_all_relative for m in metrics),
                    "step_time_s_max": max(m.step_time_s for m in metrics),
                })
                if progress is not None:
                    progress(rows[-1])
    return rows


def format_timing(rows: list[dict[str, Any]]) -> str:
    world_sizes = sorted({r["world_size"] for r in rows})
    lines = ["planning time, median ms: FlexUlysses wall / CPU (veRL KK bucketing wall)",
             f"{'sequences':>10}" + "".join(f"{f'W={w}':>22}" for w in world_sizes)]
    for num in sorted({r["num_sequences"] for r in rows}):
        cells = {r["world_size"]: r for r in rows if r["num_sequences"] == num}
        lines.append(f"{num:>10}" + "".join(
            f"{cells[w]['plan_ms']:>7.1f}/{cells[w]['plan_cpu_ms']:>5.1f} ({cells[w]['verl_ms']:>5.1f})"
            for w in world_sizes))
    return "\n".join(lines)


def format_quality(rows: list[dict[str, Any]]) -> str:
    lines = ["FlexUlysses plan quality (worst over seeds): efficiency / cost balance / attention balance / "
             "a2a vs SP=p_max (mean); * = lower bound set by the longest sequence; "
             "! = no aligned plan reaches 0.97 (efficiency bound, metrics.py; the block partition and each "
             "sequence's share on its busiest rank); "
             "with a calibration, the worst projected step time in ms follows"]
    counts = sorted({r["num_sequences"] for r in rows})
    for mix in dict.fromkeys(r["mix"] for r in rows):
        lines.append(f"{mix}")
        lines.append(f"{'W':>5}" + "".join(f"{f'N={n}':>26}" for n in counts))
        for world_size in sorted({r["world_size"] for r in rows if r["mix"] == mix}):
            cells = {r["num_sequences"]: r for r in rows if r["mix"] == mix and r["world_size"] == world_size}
            lines.append(f"{world_size:>5}" + "".join(
                f"{c['efficiency_min']:>7.3f}/{c['cost_balance_max']:.2f}/{c['attention_balance_max']:.2f}"
                f"/{c['all_to_all_relative_mean']:.2f}{'*' if c['lb_is_longest'] else ' '}"
                f"{'!' if c['efficiency_bound_min'] < 0.97 else ' '}"
                f"{_step_cell(c)}"
                for c in (cells[n] for n in counts)))
    return "\n".join(lines)


def _step_cell(cell: dict[str, Any]) -> str:
    """' <worst projected step ms>' with a calibration, '' without."""
    return f" {cell['step_time_s_max'] * 1e3:.0f}" if cell.get("step_time_s_max") else ""
