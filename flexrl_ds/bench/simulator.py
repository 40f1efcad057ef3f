"""`flexrl simulate`: FlexUlysses against bucketing and fixed-degree SP on generated GRPO steps.

For each seed one step (`gbs` prompts × `n_samples`) of a mix is generated and planned by every
method; the table reports the mean over seeds of each metric, the plot the per-rank loads of the
first seed. Nothing runs on devices: loads are the cost model's (docs/PLAN_SCHEMA.md).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flexrl_ds.bench.workloads import make_step
from flexrl_ds.common.output_files import output_file
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.baselines import MethodResult, fixed_sp, lpt_bucketing, verl_bucketing
from flexrl_ds.planning.cost_model import CostModel
from flexrl_ds.planning.plan import validate_plan
from flexrl_ds.planning.planner import PlannerOptions, plan_step
from flexrl_ds.planning.schedule import check_schedule
from flexrl_ds.planning.step_time import describe_links

TABLE_METRICS = ("attention_balance", "attention_balance_bound", "cost_balance", "token_balance", "efficiency",
                 "efficiency_bound", "all_to_all_relative", "num_packs", "step_time_s", "compute_s",
                 "exposed_all_to_all_s", "idle_s", "plan_ms")
"""Columns of the table (PlanMetrics fields plus planning time)."""
BREAKDOWN_METRICS = ("mean_compute_s", "mean_exposed_all_to_all_s")
"""Also averaged per method: with idle_s they split the step time (projection tables and plot)."""
COLLECTED = TABLE_METRICS[:-1] + BREAKDOWN_METRICS + ("plan_ms",)


@dataclass
class SimulationResult:
    """Mean metrics per method, and the first seed's per-rank loads for the plot."""

    mix: str
    world_size: int
    gbs: int
    n_samples: int
    seeds: int
    means: dict[str, dict[str, float]] = field(default_factory=dict)
    """method -> metric -> mean over seeds."""
    first_seed: dict[str, MethodResult] = field(default_factory=dict)
    """method -> its result on seed 0 (per-rank loads for plots)."""

    def to_json(self) -> dict[str, Any]:
        return {"mix": self.mix, "world_size": self.world_size, "gbs": self.gbs, "n_samples": self.n_samples,
                "seeds": self.seeds, "methods": self.means}


def default_extra_p_maxes(world_size: int, sp: SPConfig, cost: CostModel) -> tuple[int, ...]:
    """The widest degree cap the SP domain and the model allow, if above `sp.p_max`.

    Fixed SP is compared at 2/4/8; FlexUlysses only gives its largest degree to the few sequences
    that need it, so a second row shows it with the cap the hardware allows: the largest power of
    two ≤ min(world size, query heads) (Qwen2.5-VL-7B on 32 ranks: 16).
    """
    limit = min(world_size, cost.num_heads)
    widest = 1 << (limit.bit_length() - 1)
    return (widest,) if widest > sp.p_max else ()


def run_methods(workload, world_size: int, cost: CostModel, sp: SPConfig,
                options: PlannerOptions | None = None,
                extra_p_maxes: tuple[int, ...] = ()) -> list[tuple[MethodResult, float]]:
    """Every method on one workload: (result, planning seconds); all plans are validated.

    `extra_p_maxes` adds a FlexUlysses row per degree cap ("FlexUlysses p≤16") beside the one at
    `sp.p_max`.
    """
    p_max = sp.p_max
    runs: list[tuple[str, Any]] = [
        ("bucketing (veRL)", lambda: verl_bucketing(workload, world_size, cost, p_max)),
        ("bucketing (LPT)", lambda: lpt_bucketing(workload, world_size, cost, p_max)),
    ]
    for degree in (2, 4, 8):
        if degree <= world_size and world_size % degree == 0:
            runs.append((f"SP={degree}", lambda d=degree: fixed_sp(workload, world_size, cost, d, max(p_max, d))))

    def flex(name: str, flex_sp: SPConfig) -> MethodResult:
        result = plan_step(workload, world_size, cost, flex_sp, options)
        return MethodResult(name, result.plan, result.metrics)

    runs.append(("FlexUlysses", lambda: flex("FlexUlysses", sp)))
    for cap in extra_p_maxes:
        name = f"FlexUlysses p<={cap}"
        runs.append((name, lambda n=name, c=cap: flex(n, dataclasses.replace(sp, p_max=c))))
    out = []
    for _, run in runs:
        start = time.perf_counter()
        result = run()
        seconds = time.perf_counter() - start
        validate_plan(result.plan, workload)
        assert check_schedule(result.plan).deadlock_free, result.name
        out.append((result, seconds))
    return out


def simulate(mix: str, world_size: int, gbs: int, n_samples: int, seeds: int, cost: CostModel, sp: SPConfig,
             options: PlannerOptions | None = None, progress=None,
             extra_p_maxes: tuple[int, ...] = ()) -> SimulationResult:
    """Mean metrics over `seeds` generated steps (seeds 0..seeds-1); see `run_methods`."""
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    sim = SimulationResult(mix, world_size, gbs, n_samples, seeds)
    samples: dict[str, list[list[float]]] = {}
    for seed in range(seeds):
        workload = make_step(mix, gbs, n_samples, seed)
        for result, seconds in run_methods(workload, world_size, cost, sp, options, extra_p_maxes):
            summary = result.metrics.summary()
            row = [float(summary[k]) for k in COLLECTED if k != "plan_ms"] + [seconds * 1000]
            samples.setdefault(result.name, []).append(row)
            if seed == 0:
                sim.first_seed[result.name] = result
        if progress is not None:
            progress(seed + 1, seeds)
    for name, rows in samples.items():
        sim.means[name] = dict(zip(COLLECTED, np.mean(rows, axis=0).tolist()))
    return sim


def format_table(sim: SimulationResult) -> str:
    header = (f"{sim.mix}, {sim.world_size} ranks, {sim.gbs} prompts x {sim.n_samples} samples, "
              f"mean over {sim.seeds} seed(s)")
    names = ["attn bal", "attn LB", "cost bal", "tok bal", "effic.", "eff UB", "a2a/SPmax", "packs", "step ms",
             "comp ms", "a2a ms", "idle ms", "plan ms"]
    timed = any(values["step_time_s"] > 0 for values in sim.means.values())
    columns = [k for k in TABLE_METRICS if timed or not k.endswith("_s")]
    names = [n for n, k in zip(names, TABLE_METRICS) if k in columns]
    lines = [header, f"{'method':<18}" + "".join(f"{n:>11}" for n in names)]
    footer = ("attn LB / eff UB: no plan on aligned groups of <= p_max ranks has a lower attention balance / "
              "a higher efficiency (bounds in flexrl_ds/planning/metrics.py); a2a/SPmax: all-to-all volume / fixed "
              "SP at the row's degree cap")
    per_rank = sim.gbs * sim.n_samples / sim.world_size
    if per_rank >= 4:
        footer += (f"\nnote: {per_rank:.0f} sequences per rank, so whole-sequence bucketing balances well; the "
                   "paper's reference (bucketing ~6.7 at 32 ranks) is a micro-step of ~2 sequences per rank, "
                   "e.g. --gbs 64 --n-samples 1")
    if timed:
        footer += ("\nstep/comp/a2a/idle ms: PROJECTED step time of the busiest rank (compute, all-to-all not "
                   "hidden by overlap) and the mean idle wait, from the calibration's model (planning/step_time.py)")
    for method, values in sim.means.items():
        cells = "".join(f"{values[k] * 1000:>11.1f}" if k.endswith("_s") else
                        f"{values[k]:>11.3f}" if k not in ("num_packs", "plan_ms") else f"{values[k]:>11.1f}"
                        for k in columns)
        lines.append(f"{method:<18}{cells}")
    return "\n".join(lines + [footer])


def plot_loads(sim: SimulationResult, path: str) -> None:
    """Per-rank attention and cost (÷ mean) for each method on seed 0, as bar charts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(sim.first_seed)
    fig, axes = plt.subplots(len(methods), 2, figsize=(13, 1.9 * len(methods) + 0.8), sharex=True,
                             squeeze=False)
    ranks = np.arange(sim.world_size)
    for row, method in enumerate(methods):
        metrics = sim.first_seed[method].metrics
        for col, (label, loads, ratio) in enumerate((
                ("attention L²/d", metrics.rank_attention, metrics.attention_balance),
                ("cost (L²+cL)/d", metrics.rank_cost, metrics.cost_balance))):
            values = np.asarray(loads) / max(float(np.mean(loads)), 1e-30)
            ax = axes[row][col]
            ax.bar(ranks, values, color="tab:red" if ratio > 1.5 else "tab:blue", width=0.85)
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
            ax.set_title(f"{method}: {label}, max/mean = {ratio:.2f}", fontsize=9, loc="left")
            ax.set_ylabel("÷ mean", fontsize=8)
            ax.tick_params(labelsize=7)
    for col in range(2):
        axes[-1][col].set_xlabel("rank")
    fig.suptitle(f"Per-rank load, {sim.mix}, {sim.world_size} ranks, {sim.gbs}×{sim.n_samples} sequences "
                 f"(seed 0)", fontsize=11)
    fig.tight_layout()
    fig.savefig(output_file(path), dpi=110)
    plt.close(fig)


@dataclass
class Projection:
    """`flexrl simulate --world-sizes`: one simulation per world size with the calibrated model."""

    runs: list[SimulationResult]
    """One per world size, ascending."""
    links: list[str]
    """The all-to-all figures used per group size, each marked measured or assumed."""
    calibration: str
    """Calibration file the model came from."""
    weak_scaling: bool
    """True: prompts per step grow with the world size (the same per-GPU load)."""

    def to_json(self) -> dict[str, Any]:
        return {"projection": True, "calibration": self.calibration, "links": self.links,
                "weak_scaling": self.weak_scaling, "runs": [run.to_json() for run in self.runs]}


def project(mix: str, world_sizes: tuple[int, ...], gbs: int, n_samples: int, seeds: int, cost: CostModel,
            sp: SPConfig, options: PlannerOptions | None = None, weak_scaling: bool = True,
            extra_p_maxes=default_extra_p_maxes, progress=None) -> Projection:
    """`simulate` at every world size: with `weak_scaling`, `gbs` prompts at the smallest world size
    and proportionally more at larger ones; `extra_p_maxes(world_size, sp, cost)` gives each size's
    extra FlexUlysses rows. Needs a calibration with the step-time fits (planning/step_time.py)."""
    if cost.step is None:
        raise ValueError("a projection needs a calibration with step-time fits (--calibration FILE, or 'auto' "
                         "with --device 'NVIDIA H200')")
    sizes = sorted(set(world_sizes))
    runs = []
    for world_size in sizes:
        if weak_scaling and gbs * world_size % sizes[0]:
            raise ValueError(f"--gbs {gbs} x {world_size} / {sizes[0]} is not a whole number of prompts")
        step_gbs = gbs * world_size // sizes[0] if weak_scaling else gbs
        runs.append(simulate(mix, world_size, step_gbs, n_samples, seeds, cost, sp, options, None,
                             extra_p_maxes(world_size, sp, cost)))
        if progress is not None:
            progress(world_size)
    widest = max(max([min(sp.p_max, r.world_size), *extra_p_maxes(r.world_size, sp, cost)]) for r in runs)
    return Projection(runs, describe_links(cost.step, widest), cost.calibration.source, weak_scaling)


def _best_fixed(means: dict[str, dict[str, float]]) -> float:
    fixed = [v["step_time_s"] for k, v in means.items() if k.startswith("SP=")]
    return min(fixed) if fixed else float("nan")


def format_projection(proj: Projection) -> str:
    """The projected step time per world size and method, split into mean compute, exposed
    all-to-all and idle (they sum to the step), labelled as a projection."""
    first = proj.runs[0]
    lines = [f"PROJECTION (modelled, not measured) from {proj.calibration}: {first.mix}, "
             f"{first.n_samples} sample(s) per prompt, {'weak' if proj.weak_scaling else 'fixed-batch'} scaling, "
             f"mean over {first.seeds} seed(s). All-to-all per group size:"]
    lines += [f"  {line}" for line in proj.links]
    names = ("GPUs", "seqs", "method", "step ms", "= compute", "+ a2a", "+ idle", "busiest a2a", "attn bal",
             "a2a/SPcap", "vs best SP")
    lines.append(f"{names[0]:>5}{names[1]:>6}  {names[2]:<19}" + "".join(f"{n:>12}" for n in names[3:]))
    for run in proj.runs:
        best = _best_fixed(run.means)
        for method, v in run.means.items():
            cells = [v["step_time_s"], v["mean_compute_s"], v["mean_exposed_all_to_all_s"], v["idle_s"],
                     v["exposed_all_to_all_s"]]
            lines.append(f"{run.world_size:>5}{run.gbs * run.n_samples:>6}  {method:<19}"
                         + "".join(f"{x * 1000:>12.1f}" for x in cells)
                         + f"{v['attention_balance']:>12.3f}{v['all_to_all_relative']:>12.3f}"
                         + f"{v['step_time_s'] / best:>12.3f}")
    lines.append("compute / a2a / idle: means over ranks (linear + attention, all-to-all not hidden by overlap, "
                 "waiting for the busiest rank); they sum to the step. busiest a2a: the busiest rank's exposed "
                 "all-to-all. vs best SP: step ÷ the best fixed-SP row at that size.")
    return "\n".join(lines)


def plot_projection(proj: Projection, path: str) -> None:
    """Stacked bars per method: mean compute, exposed all-to-all and idle (ms) per GPU count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(m for run in proj.runs for m in run.means))
    fig, axes = plt.subplots(1, len(methods), figsize=(2.3 * len(methods) + 1, 4.2), sharey=True, squeeze=False)
    parts = (("mean_compute_s", "compute", "tab:blue"), ("mean_exposed_all_to_all_s", "exposed all-to-all",
                                                           "tab:orange"), ("idle_s", "idle (waiting)", "tab:gray"))
    for ax, method in zip(axes[0], methods):
        x = np.arange(len(proj.runs))
        bottom = np.zeros(len(proj.runs))
        for key, label, color in parts:
            values = np.array([run.means.get(method, {}).get(key, 0.0) * 1000 for run in proj.runs])
            ax.bar(x, values, bottom=bottom, color=color, label=label, width=0.7)
            bottom += values
        ax.set_xticks(x, [str(run.world_size) for run in proj.runs], fontsize=8)
        ax.set_title(method, fontsize=9)
        ax.set_xlabel("GPUs", fontsize=8)
    axes[0][0].set_ylabel("projected step time (ms)")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"PROJECTION (calibrated model, not measured): {proj.runs[0].mix}, "
                 f"{'weak' if proj.weak_scaling else 'fixed-batch'} scaling", fontsize=10)
    fig.tight_layout()
    fig.savefig(output_file(path), dpi=110)
    plt.close(fig)
