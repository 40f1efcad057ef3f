"""`flexrl bench zero3-trace`: what ZeRO-3's `stage3_max_reuse_distance` costs the host, pass by pass.

DeepSpeed's ZeRO-3 records the order in which a pass uses its modules (the trace). On every pass
that follows the recorded order, each module's release asks which of its parameters are used again
within `stage3_max_reuse_distance` elements further along the trace, and keeps those gathered. The
answer is memoised per (module, position in the trace): the first pass on a trace works it out for
every module, walking ahead over up to that many elements of modules each time, all in Python; the
later passes find it cached. With DeepSpeed's default of 1e9 elements, each of a 3B model's vision
modules walks over the rest of the vision tower and the first ~6 decoder layers: the cost grows
with the square of the modules within the distance.

This bench builds a chain of `blocks` small blocks (a norm and two linears each: four modules with
the block itself, all of them in the trace),
wraps it in a one-rank ZeRO-3 engine per reuse distance, and times `passes` no-grad forwards.
Pass 1 records the trace, pass 2 is the first on it, the rest are the steady state.
docs/BENCHMARKS.md ("ZeRO-3 trace walk") has its figures, and the same one-time cost in
the GPU trainer's runs: each engine's second pass, the first on its trace.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

DEEPSPEED_DEFAULT_REUSE = 1e9


@dataclass(frozen=True)
class TraceBenchConfig:
    blocks: int = 200
    """Blocks of the chain (its modules: `trace_modules`)."""
    width: int = 64
    """Width of each block's norm and linears."""
    reuse_distances: tuple[float, ...] = (DEEPSPEED_DEFAULT_REUSE, 1e5, 0.0)
    """`stage3_max_reuse_distance` values, in elements, one engine each."""
    passes: int = 4
    """No-grad passes per engine: 1 records the trace, 2 is the first on it, the rest are steady."""

    def __post_init__(self) -> None:
        if self.blocks < 1 or self.width < 1:
            raise ValueError(f"--blocks and --width must be at least 1, got {self.blocks} and {self.width}")
        if self.passes < 3:
            raise ValueError(f"--passes must be at least 3 (record, first on the trace, steady), got {self.passes}")
        if not self.reuse_distances or not all(0 <= value < float("inf") for value in self.reuse_distances):
            raise ValueError(f"--reuse: one or more distances of 0 or more elements, got {self.reuse_distances}")

    @property
    def trace_modules(self) -> int:
        """Modules in ZeRO-3's trace: each block, its norm and two linears, and the chain itself."""
        return 4 * self.blocks + 1


@dataclass
class TraceBenchRow:
    reuse_distance: float
    seconds: list[float] = field(default_factory=list)
    """Each pass's host wall time, in order."""

    @property
    def steady_s(self) -> float:
        return statistics.median(self.seconds[2:])

    @property
    def first_on_trace_extra_s(self) -> float:
        """What the first pass on the recorded trace took beyond a steady one."""
        return self.seconds[1] - self.steady_s


def chain_model(blocks: int, width: int):
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(width)
            self.up = torch.nn.Linear(width, width)
            self.down = torch.nn.Linear(width, width)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))

    return torch.nn.Sequential(*[Block() for _ in range(blocks)])


def engine_config(reuse_distance: float) -> dict:
    return {"train_micro_batch_size_per_gpu": 1,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "stage3_max_reuse_distance": int(reuse_distance)},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}


def time_passes(config: TraceBenchConfig, reuse_distance: float, device) -> TraceBenchRow:
    import deepspeed
    import torch

    model = chain_model(config.blocks, config.width)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=engine_config(reuse_distance))
    engine.eval()
    inputs = torch.randn(4, config.width, device=device)
    row = TraceBenchRow(reuse_distance)
    with torch.no_grad():
        for _ in range(config.passes):
            started = time.perf_counter()
            engine(inputs).sum().item()  # waits for the device
            row.seconds.append(time.perf_counter() - started)
    return row


def run_trace_bench(config: TraceBenchConfig, progress: Callable[[str], None] = print) -> list[TraceBenchRow]:
    # lazy: DeepSpeed and torch.distributed only when the bench runs
    from flexrl_ds.parallel.launch import init_distributed, one_rank_env

    context = init_distributed(one_rank_env("flexrl bench zero3-trace"))
    progress(f"bench zero3-trace: {config.blocks} blocks of width {config.width} ({config.trace_modules} modules), "
             f"{config.passes} no-grad passes per reuse distance, on {context.device}")
    rows = []
    for reuse_distance in config.reuse_distances:
        rows.append(time_passes(config, reuse_distance, context.device))
        progress(f"bench zero3-trace: reuse distance {reuse_distance:g}: "
                 f"{', '.join(f'{s:.3f}' for s in rows[-1].seconds)} s")
    return rows


def format_rows(rows: list[TraceBenchRow]) -> str:
    lines = [f"{'reuse distance':>15}{'pass 1 s':>10}{'pass 2 s':>10}{'steady s':>10}{'pass 2 extra s':>16}"]
    for row in rows:
        lines.append(f"{row.reuse_distance:>15g}{row.seconds[0]:>10.3f}{row.seconds[1]:>10.3f}"
                     f"{row.steady_s:>10.3f}{row.first_on_trace_extra_s:>16.3f}")
    lines.append("pass 1 records ZeRO-3's module trace; pass 2 is the first on it; steady: the median of the rest")
    return "\n".join(lines)
