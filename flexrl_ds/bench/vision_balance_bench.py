"""`flexrl bench vision`: how evenly the vision tower's work lands on ranks, per placement policy.

For a generated GRPO step (bench/workloads.py mixes) planned by the FlexUlysses planner, count the
patches each rank of the SP domain encodes under three policies:
- `sequence-owner`: the first rank of a sequence's pack encodes all its images/frames (what a model
  forward per pack does without vision balancing);
- `pack-group`: a pack's units are spread (largest first) over the ranks of its own group;
- `domain` (flexrl_ds/models/vision_balance.py): units spread over all ranks of the domain.
Units: an image, or a temporal group of two frames; patches per unit = 4 × merged vision tokens of
the unit (2×2 merge). Pure computation (no model); the balance ratio is max / mean patches per rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexrl_ds.bench.workloads import make_step
from flexrl_ds.common.output_files import output_file
from flexrl_ds.models.vision_balance import assign_units
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.planning.planner import plan_step

POLICIES = ("sequence-owner", "pack-group", "domain")


@dataclass(frozen=True)
class VisionBalanceRow:
    """One policy's result."""

    policy: str
    max_patches: int
    """Patches on the busiest rank."""
    mean_patches: float
    balance: float
    """max / mean patches per rank (1.0 = perfect)."""


def sequence_units(seq) -> list[int]:
    """Patch counts of a workload sequence's vision units (images, then temporal groups)."""
    patches = 4 * seq.vision_tokens
    if seq.frames:
        groups = max(1, seq.frames // 2)
        return [patches // groups] * groups
    if seq.images:
        return [patches // seq.images] * seq.images
    return []


def patches_per_rank(plan, workload, policy: str) -> list[int]:
    by_id = workload.by_id()
    loads = [0] * plan.world_size
    all_units: list[int] = []
    for pack in plan.packs:
        units = [p for seq_id in pack.sequences for p in sequence_units(by_id[seq_id])]
        if policy == "sequence-owner":
            loads[pack.ranks[0]] += sum(units)
        elif policy == "pack-group":
            for unit, index in zip(units, assign_units(units, pack.degree)):
                loads[pack.ranks[index]] += unit
        else:
            all_units.extend(units)
    if policy == "domain":
        for unit, rank in zip(all_units, assign_units(all_units, plan.world_size)):
            loads[rank] += unit
    return loads


def compare(plan, workload) -> list[VisionBalanceRow]:
    rows = []
    for policy in POLICIES:
        loads = patches_per_rank(plan, workload, policy)
        mean = sum(loads) / len(loads)
        rows.append(VisionBalanceRow(policy, max(loads), mean, max(loads) / mean if mean else 1.0))
    return rows


def run(mix: str, num_prompts: int, n_samples: int, world_size: int, p_max: int, seed: int,
        plot: str | None = None) -> list[VisionBalanceRow]:
    """Generate a step, plan it, compare the policies; optional bar plot of patches per rank."""
    workload = make_step(mix, num_prompts, n_samples, seed)
    plan = plan_step(workload, world_size, load_cost_model("qwen2.5-vl-7b"), SPConfig(p_max=p_max)).plan
    rows = compare(plan, workload)
    if plot:
        _plot(plan, workload, plot, f"{mix}, {num_prompts}x{n_samples} seqs, {world_size} ranks, p_max {p_max}")
    return rows


def _plot(plan, workload, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    width = 0.28
    for index, policy in enumerate(POLICIES):
        loads = patches_per_rank(plan, workload, policy)
        ax.bar([r + (index - 1) * width for r in range(len(loads))], loads, width, label=policy)
    ax.set_xlabel("rank")
    ax.set_ylabel("vision patches encoded")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(output_file(path), dpi=110)
    plt.close(fig)
