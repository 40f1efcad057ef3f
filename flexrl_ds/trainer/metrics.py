"""What a training run writes about each step: metrics.jsonl, TensorBoard, console line, a plot.

`StepLog` appends one JSON object per step to OUT/metrics.jsonl (on resume the lines of steps after
the checkpoint are dropped first, so the file reads as one run), mirrors every number to
TensorBoard (OUT/tensorboard, when `tensorboard` is installed) and wandb (when asked and installed),
prints one progress line per step, and at the end draws OUT/metrics.png (reward with its trailing
mean, loss, KL, response length, per-phase time and peak memory per step).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from flexrl_ds.runtime.host_memory import ray_kill_share
from flexrl_ds.trainer.floor_metrics import floor_text

logger = logging.getLogger(__package__)

PHASES = ("data", "rollout", "reward", "inference", "update", "sync", "step")
"""Keys of `time_s`: where a step's wall time went (`step` is the whole step)."""


def flatten(metrics: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numbers of a nested metrics dict as {"time_s/rollout": ...}."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def progress_line(metrics: dict[str, Any], max_steps: int) -> str:
    times = metrics["time_s"]
    return (f"step {metrics['step'] + 1}/{max_steps} | reward {metrics['reward_mean']:.3f} ± "
            f"{metrics['reward_std']:.3f}"
            f" | loss {metrics['loss']:+.4f} kl {metrics['kl']:.4f} clip {metrics['clip_frac']:.3f}"
            f" | len {metrics['response_length_mean']:.1f} | {times['step']:.1f} s (data {times.get('data', 0.0):.1f},"
            f" rollout {times['rollout']:.1f},"
            f" inference {times['inference']:.1f}, update {times['update']:.1f}, sync {times['sync']:.2f})"
            f" | {metrics['tokens_per_gpu_s']:.0f} tok/GPU/s"
            + (f", MFU update {100 * metrics['mfu']['update']:.0f}%" if "mfu" in metrics else "")
            + floor_text(metrics))


class StepLog:
    """Per-step outputs of one run directory."""

    def __init__(self, out_dir: str | Path, resume_after_step: int | None = None, tensorboard: bool = True,
                 wandb_project: str | None = None, run_name: str = "flexrl"):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows = [] if resume_after_step is None else self._kept_rows(resume_after_step)
        self.path.write_text("".join(json.dumps(row) + "\n" for row in self.rows))
        self.writer = _tensorboard(Path(out_dir) / "tensorboard") if tensorboard else None
        self.wandb = _wandb(wandb_project, run_name) if wandb_project else None

    def _kept_rows(self, last_step: int) -> list[dict]:
        if not self.path.exists():
            return []
        rows = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
        return [row for row in rows if row["step"] <= last_step]

    def write(self, metrics: dict[str, Any], max_steps: int) -> None:
        self.rows.append(metrics)
        with self.path.open("a") as handle:
            handle.write(json.dumps(metrics) + "\n")
        scalars = flatten(metrics)
        if self.writer is not None:
            for name, value in scalars.items():
                if name != "step":
                    self.writer.add_scalar(name, value, metrics["step"])
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=metrics["step"])
        logger.info(progress_line(metrics, max_steps))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.rows:
            plot_metrics(self.rows, self.path.parent / "metrics.png")


def _tensorboard(directory: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        logger.warning("flexrl train: tensorboard is not installed; metrics go to metrics.jsonl only")
        return None
    return SummaryWriter(str(directory))


def _wandb(project: str, run_name: str):
    try:
        import wandb
    except ImportError:
        logger.warning(f"flexrl train: wandb is not installed; flexrl.trainer.wandb_project={project!r} ignored")
        return None
    return wandb.init(project=project, name=run_name)


def plot_metrics(rows: list[dict], path: Path) -> None:
    """Reward, loss, KL, response length and phase times per step, the peak device memory per phase
    on GPUs, and the peak host memory in use per phase on the policy ranks' nodes, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [row["step"] for row in rows]
    memory = [key for key in ("peak_device_used_gb", "peak_host_used_gb")
              if any(any(r.get(key, {}).values()) for r in rows)]
    fig, axes = plt.subplots(1, 4 + len(memory), figsize=(4 * (4 + len(memory)), 3.4))
    _plot_reward(axes[0], rows)
    _plot_loss_and_kl(axes[1], rows)
    axes[2].plot(steps, [r["response_length_mean"] for r in rows], marker="o", markersize=3)
    axes[2].set_title("response length (tokens)")
    bottom = [0.0] * len(rows)
    for phase in PHASES[:-1]:
        values = [r["time_s"][phase] for r in rows]
        axes[3].bar(steps, values, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[3].legend(fontsize=7)
    axes[3].set_title("time per phase (s)")
    for axis, key in zip(axes[4:], memory):
        _plot_memory(axis, rows, key)
    for axis in axes:
        axis.set_xlabel("step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))  # a short run: no ticks between steps
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Each value averaged with the `window` - 1 before it (fewer where the series starts)."""
    means, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        means.append(total / min(index + 1, window))
    return means


def _plot_reward(axis, rows: list[dict]) -> None:
    """The reward per step with its spread over the step's samples, and its trailing mean over a
    tenth of the run, which shows the trend that the noisy steps hide."""
    steps = [row["step"] for row in rows]
    means = [row["reward_mean"] for row in rows]
    spread = [row["reward_std"] for row in rows]
    axis.fill_between(steps, [m - s for m, s in zip(means, spread)], [m + s for m, s in zip(means, spread)],
                      alpha=0.2, label="± std over samples")
    axis.plot(steps, means, marker="o", markersize=3, linewidth=0.8, label="mean")
    window = max(1, len(rows) // 10)
    if window > 1:
        axis.plot(steps, trailing_mean(means, window), color="black", linewidth=2,
                  label=f"mean of the last {window} steps")
    axis.legend(fontsize=7)
    axis.set_title("reward")


def _plot_loss_and_kl(axis, rows: list[dict]) -> None:
    """The GRPO loss on the left axis, the KL to the reference on its own right axis: the two
    differ by orders of magnitude, and one scale would flatten the loss."""
    steps = [row["step"] for row in rows]
    loss_line = axis.plot(steps, [r["loss"] for r in rows], marker="o", markersize=3, label="loss")
    axis.set_ylabel("loss")
    kl_axis = axis.twinx()
    kl_line = kl_axis.plot(steps, [r["kl"] for r in rows], marker="o", markersize=3, color="tab:orange", label="kl")
    kl_axis.set_ylabel("kl")
    lines = loss_line + kl_line
    kl_axis.legend(lines, [line.get_label() for line in lines], fontsize=7)  # drawn over the loss axis
    axis.set_title("loss and KL to the reference")


MEMORY_TITLES = {"peak_device_used_gb": "peak device memory in use (GiB)",
                 "peak_host_used_gb": "peak host memory in use, node (GiB)"}


def _plot_memory(axis, rows: list[dict], key: str) -> None:
    """One memory panel: the peak of `key` per phase and step (and a colocated engine's awake peak
    on the device's)."""
    steps = [row["step"] for row in rows]
    for phase in ("rollout", "inference", "update", "sync"):
        axis.plot(steps, [r.get(key, {}).get(phase, 0.0) for r in rows], marker="o", markersize=3, label=phase)
    if key == "peak_device_used_gb" and any(r.get("rollout_engine_peak_gb") for r in rows):
        axis.plot(steps, [r.get("rollout_engine_peak_gb", 0.0) for r in rows], linestyle="--", marker="x",
                  label="engine awake")  # colocated engines: wake to end of generation
    if key == "peak_host_used_gb":
        _plot_host_kill_line(axis, rows)
    axis.legend(fontsize=7)
    axis.set_title(MEMORY_TITLES[key])


def _plot_host_kill_line(axis, rows: list[dict]) -> None:
    """Where Ray's memory monitor kills workers on the busiest node: the node's memory (a phase's
    peak over its share) times the kill share (runtime/host_memory.py)."""
    nodes = [row["peak_host_used_gb"][phase] / share for row in rows
             for phase, share in row.get("peak_host_used_share", {}).items() if share > 0]
    if nodes:
        axis.axhline(max(nodes) * ray_kill_share(), color="black", linestyle=":", label="Ray kills above")
