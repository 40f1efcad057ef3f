"""`flexrl bench sp`: forward+backward time of one decoder layer under three SP systems.

For one skewed batch (a few long sequences and many short ones) the same layer runs under
- **FlexUlysses**: the planner's plan (degrees 1..p_max, packs, HSF order), FlexUlyssesAttention;
- **bucketing**: whole sequences (degree 1 everywhere), balanced by the planner's LPT baseline;
- **fixed SP=d**: DeepSpeed's DistributedAttention on fixed groups of d (flexrl_ds/sp/fixed_sp.py).
Each rank holds its local tokens (layout of the system's plan); one step = forward + backward of the
layer on them; the step time is the slowest rank's (a barrier closes every step). Rank 0 prints a
table and returns the JSON record. The layer is a Qwen2-style block without rotary embeddings
(norm, q/k/v/o projections with FlexUlysses attention, norm, gated MLP) or its attention part only.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flexrl_ds.bench.sp_calibrate import calibrate_rank
from flexrl_ds.common.output_files import output_file
from flexrl_ds.parallel import device as device_mod
from flexrl_ds.parallel.group_tree import GroupTree, SPTopology
from flexrl_ds.parallel.launch import init_distributed
from flexrl_ds.planning.baselines import lpt_bucketing
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.planning.plan import SequenceSpec, Workload, load_workload
from flexrl_ds.planning.planner import plan_step
from flexrl_ds.sp.attention import FlexUlyssesAttention
from flexrl_ds.sp.fixed_sp import FixedUlyssesAttention, fixed_sp_plan
from flexrl_ds.sp.layout import build_rank_layout
from flexrl_ds.sp.local_attention import CausalVarlenAttention, pick_backend

logger = logging.getLogger(__package__)

SHAPES = {
    # hidden, heads, kv heads, head_dim, MLP
    "7b": (3584, 28, 4, 128, 18944),
    "tiny": (128, 8, 2, 16, 256),
}


@dataclass
class SPBenchConfig:
    """Options of one `flexrl bench sp` run (same on every rank)."""

    shape: str = "7b"
    """Layer width preset: 7b (Qwen2.5-VL-7B LLM layer) or tiny (CPU smoke runs)."""
    layer: str = "decoder"
    """decoder (attention + MLP) or attention (projections + attention only)."""
    long_tokens: tuple[int, ...] = (49152,)
    """Lengths of the long sequences of the skewed batch (videos)."""
    num_short: int = 24
    """Number of short sequences (images), lengths drawn in [short_min, short_max]."""
    short_min: int = 600
    """Shortest short sequence."""
    short_max: int = 3000
    """Longest short sequence."""
    workload: str | None = None
    """A workload JSON (docs/PLAN_SCHEMA.md) to use instead of the generated skewed batch."""
    p_max: int = 8
    """Largest FlexUlysses degree (clamped to the world size)."""
    fixed_degree: int = 2
    """Degree of the fixed-SP baseline."""
    systems: tuple[str, ...] = ("flex", "bucketing", "fixed")
    """Systems to time, in order."""
    dtype: str = "bfloat16"
    """Tensor dtype of the layer and activations."""
    warmup: int = 2
    """Untimed steps per system."""
    iters: int = 5
    """Timed steps per system (the table shows the median)."""
    seed: int = 0
    """Seed of the batch lengths, weights and activations."""
    overlap: bool = True
    """FlexUlysses overlap of pack j+1's all-to-all with pack j's attention."""
    calibrate: bool = False
    """Measure the cost model's constants (flexrl_ds/bench/sp_calibrate.py) instead of comparing systems."""


@dataclass
class SystemResult:
    """Timing of one system on the batch."""

    name: str
    """flex | bucketing | fixed SP=d."""
    step_ms: list[float] = field(default_factory=list)
    """Forward+backward time of each timed step (slowest rank)."""
    max_local_tokens: int = 0
    """Tokens on the fullest rank."""
    min_local_tokens: int = 0
    """Tokens on the emptiest rank."""
    num_packs: int = 0
    degrees: dict[str, int] = field(default_factory=dict)
    """Degree -> number of packs of that degree in the plan."""
    attention_backend: str = ""
    """Local attention kernel and exchange used."""

    @property
    def median_ms(self) -> float:
        return statistics.median(self.step_ms) if self.step_ms else float("nan")


def skewed_lengths(config: SPBenchConfig) -> dict[str, int]:
    """The batch: `long_tokens` videos + `num_short` images with seeded lengths."""
    if config.workload:
        return {s.id: s.tokens for s in load_workload(config.workload).sequences}

    rng = random.Random(config.seed)
    lengths = {f"video{i}": n for i, n in enumerate(config.long_tokens)}
    for i in range(config.num_short):
        lengths[f"image{i}"] = rng.randint(config.short_min, config.short_max)
    return lengths


def make_plans(lengths: dict[str, int], world_size: int, config: SPBenchConfig) -> dict[str, Any]:
    """system name -> (plan, lengths incl. padding). Pure: every rank computes the same plans."""
    cost = load_cost_model("qwen2.5-vl-7b")
    workload = Workload(tuple(SequenceSpec(id=s, tokens=n) for s, n in lengths.items()))
    p_max = min(config.p_max, world_size)
    plans = {}
    for system in config.systems:
        if system == "flex":
            plans["flex"] = (plan_step(workload, world_size, cost, SPConfig(p_max=p_max)).plan, lengths)
        elif system == "bucketing":
            plans["bucketing"] = (lpt_bucketing(workload, world_size, cost, p_max).plan, lengths)
        elif system == "fixed":
            costs = {s: n * n + cost.c * n for s, n in lengths.items()}
            plans[f"fixed SP={config.fixed_degree}"] = fixed_sp_plan(lengths, world_size, config.fixed_degree, costs)
        else:
            raise ValueError(f"bench sp: unknown system {system!r} (flex, bucketing, fixed)")
    return plans


class DecoderLayer:
    """A Qwen2-style layer (no rotary) whose attention is a given SP attention callable."""

    def __init__(self, shape: str, with_mlp: bool, device, dtype, seed: int):
        if shape not in SHAPES:
            raise ValueError(f"bench sp: unknown shape {shape!r}; one of {', '.join(SHAPES)}")
        hidden, heads, kv_heads, head_dim, mlp = SHAPES[shape]
        self.heads, self.kv_heads, self.head_dim, self.with_mlp = heads, kv_heads, head_dim, with_mlp
        gen = torch.Generator().manual_seed(seed)

        def weight(rows, cols):
            return (torch.randn(rows, cols, generator=gen) / cols ** 0.5).to(device, dtype).requires_grad_(True)

        self.wqkv = weight((heads + 2 * kv_heads) * head_dim, hidden)
        self.wo = weight(hidden, heads * head_dim)
        self.w_gate_up = weight(2 * mlp, hidden) if with_mlp else None
        self.w_down = weight(hidden, mlp) if with_mlp else None

    def parameters(self):
        return [w for w in (self.wqkv, self.wo, self.w_gate_up, self.w_down) if w is not None]

    def __call__(self, x_LH, attention, layout):
        tokens = x_LH.shape[0]
        h = F.rms_norm(x_LH, (x_LH.shape[1],))
        qkv = F.linear(h, self.wqkv).view(tokens, self.heads + 2 * self.kv_heads, self.head_dim)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)
        attn = attention(q, k, v, layout)
        x_LH = x_LH + F.linear(attn.reshape(tokens, -1), self.wo)
        if self.with_mlp:
            gate, up = F.linear(F.rms_norm(x_LH, (x_LH.shape[1],)), self.w_gate_up).chunk(2, dim=-1)
            x_LH = x_LH + F.linear(F.silu(gate) * up, self.w_down)
        return x_LH


def _time_system(name, plan, lengths, tree, layer, config, ctx) -> SystemResult:
    layout = build_rank_layout(plan, lengths, tree.local_rank, tree, num_heads=layer.heads,
                               num_kv_heads=layer.kv_heads)
    if name.startswith("fixed"):
        attention: Any = FixedUlyssesAttention()
        backend_note = f"exchange={attention.backend}"
    else:
        attention = FlexUlyssesAttention(CausalVarlenAttention(), overlap=config.overlap)
        backend_note = "exchange=flex" + ("+overlap" if config.overlap else "")
    dtype = getattr(torch, config.dtype)
    gen = torch.Generator().manual_seed(config.seed + tree.local_rank)
    x = torch.randn(layout.num_local_tokens, layer.wo.shape[0], generator=gen).to(ctx.device, dtype)
    probe = torch.empty(1, 1, 1, device=ctx.device, dtype=dtype)
    result = SystemResult(name=name, num_packs=len(plan.packs),
                          attention_backend=f"{pick_backend('auto', probe).__name__}, {backend_note}")
    counts = torch.tensor([layout.num_local_tokens], device=ctx.device)
    gathered = [torch.zeros_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, counts)
    result.max_local_tokens = int(max(t.item() for t in gathered))
    result.min_local_tokens = int(min(t.item() for t in gathered))
    for pack in plan.packs:
        result.degrees[str(pack.degree)] = result.degrees.get(str(pack.degree), 0) + 1
    for step in range(config.warmup + config.iters):
        for weight in layer.parameters():
            weight.grad = None
        x_in = x.detach().requires_grad_(True)
        device_mod.synchronize(ctx.info)
        dist.barrier()
        start = time.perf_counter()
        out = layer(x_in, attention, layout)
        # Always backward, even with no local tokens: the packs' all-to-alls need every rank.
        (out.float().square().sum() / max(1, out.numel())).backward()
        device_mod.synchronize(ctx.info)
        dist.barrier()
        if step >= config.warmup:
            result.step_ms.append((time.perf_counter() - start) * 1000)
    return result


def run_rank(config: SPBenchConfig) -> dict[str, Any] | None:
    """Body of one benchmark rank (torchrun-style env); returns the record on rank 0."""
    ctx = init_distributed()
    world = ctx.launch.world_size
    tree = GroupTree.create(SPTopology(world_size=world, domain_size=world,
                                       p_max=max(min(config.p_max, world), config.fixed_degree)), ctx.launch.rank)
    layer = DecoderLayer(config.shape, config.layer == "decoder" or config.calibrate, ctx.device,
                         _dtype(config.dtype), config.seed)
    if config.calibrate:
        record = calibrate_rank(config, tree, layer, ctx)
        dist.barrier()
        dist.destroy_process_group()
        return {"calibration": record} if ctx.launch.rank == 0 else None
    lengths = skewed_lengths(config)
    plans = make_plans(lengths, world, config)
    results = []
    for name, (plan, plan_lengths) in plans.items():
        if ctx.launch.rank == 0:
            logger.info(f"[bench sp] {name}: {len(plan.packs)} packs, timing {config.iters} steps ...")
        results.append(_time_system(name, plan, plan_lengths, tree, layer, config, ctx))
    dist.barrier()
    dist.destroy_process_group()
    if ctx.launch.rank != 0:
        return None
    return {
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()},
        "world_size": world, "device": ctx.info.kind, "num_sequences": len(lengths),
        "total_tokens": sum(lengths.values()), "longest": max(lengths.values()),
        "systems": [dict(asdict(r), median_ms=r.median_ms) for r in results],
    }


def _dtype(name: str):
    if name not in ("bfloat16", "float16", "float32", "float64"):
        raise ValueError(f"bench sp: --dtype {name!r} is not one of bfloat16, float16, float32, float64")
    return getattr(torch, name)


def format_table(record: dict[str, Any]) -> str:
    """Human-readable table of a `run_rank` record."""
    rows = [f"{'system':<16}{'median ms':>11}{'min ms':>9}{'vs flex':>9}{'max tok/rank':>14}"
            f"{'min tok/rank':>14}  degrees (packs)"]
    flex = next((s["median_ms"] for s in record["systems"] if s["name"] == "flex"), None)
    for s in record["systems"]:
        ratio = f"{s['median_ms'] / flex:.2f}x" if flex else "-"
        degrees = " ".join(f"d{d}:{n}" for d, n in sorted(s["degrees"].items(), key=lambda kv: int(kv[0])))
        rows.append(f"{s['name']:<16}{s['median_ms']:>11.2f}{min(s['step_ms']):>9.2f}{ratio:>9}"
                    f"{s['max_local_tokens']:>14}{s['min_local_tokens']:>14}  {degrees}")
    head = (f"world {record['world_size']} ({record['device']}), {record['num_sequences']} sequences, "
            f"{record['total_tokens']} tokens, longest {record['longest']}; layer "
            f"{record['config']['layer']} {record['config']['shape']} {record['config']['dtype']}")
    return head + "\n" + "\n".join(rows)


def write_plot(record: dict[str, Any], path: str) -> None:
    """Bar chart of median step time per system (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [s["name"] for s in record["systems"]]
    values = [s["median_ms"] for s in record["systems"]]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(names, values, color=["tab:green", "tab:gray", "tab:blue"][: len(names)])
    ax.set_ylabel("forward+backward ms (median)")
    ax.set_title(f"{record['config']['layer']} layer {record['config']['shape']}, {record['world_size']} ranks")
    fig.tight_layout()
    fig.savefig(output_file(path), dpi=120)
    plt.close(fig)


def dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, indent=1)
