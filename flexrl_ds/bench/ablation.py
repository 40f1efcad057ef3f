"""`flexrl bench ablation-report RUN_A RUN_B`: the data-loading ablation's table (issue 40), from two
`flexrl train` output folders of the same prompts, seeds and responses, one under each
`flexrl.data.loading` ("central", the veRL-style baseline, and "shadow", the ShadowLoader).

Everything comes from what each run wrote (docs/OUTPUTS.md): `metrics.jsonl`'s `time_s` (per
phase), `rollout_time_s.pixels` (the rollout's pixel pulls), `inference_time_s.batches` (the log-prob
passes' batch building, their pixel pulls included), `loader` (`exposed_s`: the seconds the loop
waited for data, `time_s.data` plus the rollout's pulls; `bytes_through_controller`: the step's bytes
through the loader's controller process, the pixels themselves when central; the controller's and
the driver's peak RSS so far), `rollout_pixel_mb`, `tokens_per_gpu_s` and `peak_host_used_gb`; and
`rollouts/step_N.jsonl`, where saved, to check that both runs trained on the same samples.

Means are over the steps after the first where a run has more than one (step 0 holds the first
compilations and the engine's first wake; the ShadowLoader has no look-ahead to hide step 0's
decode); `all_steps` takes every step. The exposed share is the averaged steps' exposed seconds
over their step seconds; peaks are the largest of the averaged steps. Pure: reads files, no Ray.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PHASES = ("data", "rollout", "reward", "inference", "update", "sync", "step")
"""`time_s` keys (trainer/metrics.py PHASES)."""
LOADER_KEYS = ("loading", "exposed_s", "bytes_through_controller", "controller_peak_rss_gb", "driver_peak_rss_gb")
"""`loader` keys (trainer/loader_metrics.py)."""


@dataclass
class RunSummary:
    """One run's figures, averaged over `steps`."""

    path: str
    loading: str
    """`flexrl.data.loading` of the run."""
    steps: list[int]
    """The steps averaged."""
    phases_s: dict[str, float]
    """Mean seconds per `time_s` phase."""
    rollout_pixel_pulls_s: float
    """Mean `rollout_time_s.pixels`."""
    logprob_batches_s: float
    """Mean `inference_time_s.batches` (batch building, the log-prob passes' pixel pulls included)."""
    exposed_s: float
    """Mean `loader.exposed_s`."""
    exposed_share: float
    """Exposed seconds over step seconds, over the averaged steps."""
    controller_mb_per_step: float
    """Mean `loader.bytes_through_controller`, MiB."""
    controller_peak_rss_gb: float
    driver_peak_rss_gb: float
    rollout_pixel_mb: float
    """Mean MiB of pixels the rollout pulled."""
    tokens_per_gpu_s: float
    """Mean `tokens_per_gpu_s`."""
    host_peak_gb: float | None
    """The largest `peak_host_used_gb` over phases (None where the run logged none)."""
    per_step: list[dict[str, float]]
    """Every step: `step`, `step_s`, `exposed_s`, `exposed_share`."""


def read_metrics(run: str | Path) -> list[dict[str, Any]]:
    """metrics.jsonl of a `flexrl train` output folder; ValueError naming the file and the key a
    step lacks."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path}: not found (RUN must be a `flexrl train` --out folder)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no step was written")
    for row in rows:
        where = f"{path}: step {row.get('step', '?')}"
        for key in ("step", "time_s", "loader", "tokens_per_gpu_s"):
            if key not in row:
                raise ValueError(f"{where} has no {key!r} (written by an older flexrl?)")
        missing = [k for k in PHASES if k not in row["time_s"]] + [k for k in LOADER_KEYS if k not in row["loader"]]
        if missing:
            raise ValueError(f"{where}: time_s / loader lack {', '.join(missing)}")
    return rows


def summarize(run: str | Path, rows: list[dict[str, Any]], all_steps: bool = False) -> RunSummary:
    """The run's figures over the steps after the first (every step with `all_steps` or one step)."""
    averaged = rows if all_steps or len(rows) == 1 else rows[1:]

    def mean(values: list[float]) -> float:
        return sum(values) / len(values)

    host = [max(row["peak_host_used_gb"].values()) for row in averaged if row.get("peak_host_used_gb")]
    loadings = {row["loader"]["loading"] for row in rows}
    if len(loadings) != 1:
        raise ValueError(f"{run}: steps under several loadings ({', '.join(sorted(loadings))})")
    return RunSummary(
        path=str(run), loading=loadings.pop(), steps=[row["step"] for row in averaged],
        phases_s={phase: mean([row["time_s"][phase] for row in averaged]) for phase in PHASES},
        rollout_pixel_pulls_s=mean([row.get("rollout_time_s", {}).get("pixels", 0.0) for row in averaged]),
        logprob_batches_s=mean([row.get("inference_time_s", {}).get("batches", 0.0) for row in averaged]),
        exposed_s=mean([row["loader"]["exposed_s"] for row in averaged]),
        exposed_share=(sum(row["loader"]["exposed_s"] for row in averaged)
                       / max(sum(row["time_s"]["step"] for row in averaged), 1e-9)),
        controller_mb_per_step=mean([row["loader"]["bytes_through_controller"] / 2**20 for row in averaged]),
        controller_peak_rss_gb=max(row["loader"]["controller_peak_rss_gb"] for row in averaged),
        driver_peak_rss_gb=max(row["loader"]["driver_peak_rss_gb"] for row in averaged),
        rollout_pixel_mb=mean([row.get("rollout_pixel_mb", 0.0) for row in averaged]),
        tokens_per_gpu_s=mean([row["tokens_per_gpu_s"] for row in averaged]),
        host_peak_gb=max(host) if host else None,
        per_step=[{"step": row["step"], "step_s": row["time_s"]["step"], "exposed_s": row["loader"]["exposed_s"],
                   "exposed_share": row["loader"]["exposed_s"] / max(row["time_s"]["step"], 1e-9)} for row in rows])


def _samples(run: Path, step: int) -> list[tuple] | None:
    path = run / "rollouts" / f"step_{step}.jsonl"
    if not path.is_file():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted((row["sample"], row["id"], tuple(row["prompt_ids"]), tuple(row["response_ids"])) for row in rows)


def same_samples(run_a: str | Path, run_b: str | Path, steps: list[int]) -> dict[str, Any] | None:
    """Whether both runs trained on the same samples (name, record, prompt and response tokens) at
    each of `steps`, from rollouts/step_N.jsonl (`flexrl.trainer.save_rollouts`); None where either
    run saved none."""
    compared, differing, differing_steps = 0, 0, []
    for step in steps:
        a, b = _samples(Path(run_a), step), _samples(Path(run_b), step)
        if a is None or b is None:
            return None
        compared += max(len(a), len(b))
        mismatched = len(set(a) ^ set(b)) // 2 + abs(len(a) - len(b))
        differing += mismatched
        differing_steps += [step] if mismatched else []
    return {"compared": compared, "differing": differing, "differing_steps": differing_steps}


def ablation_report(run_a: str | Path, run_b: str | Path, all_steps: bool = False) -> dict[str, Any]:
    """Both runs' summaries and the sample check, as JSON-ready data (`format_report` prints it)."""
    rows_a, rows_b = read_metrics(run_a), read_metrics(run_b)
    a, b = summarize(run_a, rows_a, all_steps), summarize(run_b, rows_b, all_steps)
    steps = sorted(set(row["step"] for row in rows_a) & set(row["step"] for row in rows_b))
    return {"runs": [asdict(a), asdict(b)], "same_samples": same_samples(run_a, run_b, steps)}


ROWS: tuple[tuple[str, str, str], ...] = (
    ("step (s)", "phases_s.step", "{:.2f}"),
    ("data (s)", "phases_s.data", "{:.2f}"),
    ("rollout (s)", "phases_s.rollout", "{:.2f}"),
    ("· its pixel pulls (s)", "rollout_pixel_pulls_s", "{:.2f}"),
    ("reward (s)", "phases_s.reward", "{:.2f}"),
    ("inference (s)", "phases_s.inference", "{:.2f}"),
    ("· batch building, pixel pulls included (s)", "logprob_batches_s", "{:.2f}"),
    ("update (s)", "phases_s.update", "{:.2f}"),
    ("sync (s)", "phases_s.sync", "{:.2f}"),
    ("**exposed data time (s)**", "exposed_s", "{:.3f}"),
    ("**exposed share of the step**", "exposed_share", "{:.2%}"),
    ("bytes through the controller a step (MiB)", "controller_mb_per_step", "{:.3f}"),
    ("controller peak RSS (GiB)", "controller_peak_rss_gb", "{:.2f}"),
    ("driver peak RSS (GiB)", "driver_peak_rss_gb", "{:.2f}"),
    ("rollout pixels pulled a step (MiB)", "rollout_pixel_mb", "{:.1f}"),
    ("host memory peak, node (GiB)", "host_peak_gb", "{:.1f}"),
    ("tokens/GPU/s", "tokens_per_gpu_s", "{:.0f}"),
)
"""(label, field of a `RunSummary` as JSON, "a.b" for a nested key, format) of the report's table."""


def _value(run: dict[str, Any], field: str) -> float | None:
    value: Any = run
    for part in field.split("."):
        value = value[part]
    return value


def format_report(report: dict[str, Any]) -> str:
    """`ablation_report`'s data as Markdown: the averaged figures of both runs side by side with
    their ratio (B ÷ A), the exposed time and share of every step, and the sample check."""
    a, b = report["runs"]
    names = [run["loading"] if a["loading"] != b["loading"] else Path(run["path"]).name for run in (a, b)]
    lines = [f"A: {a['path']} ({a['loading']}), B: {b['path']} ({b['loading']}); means over steps "
             f"{a['steps']} (A) and {b['steps']} (B)", "",
             f"| | A: {names[0]} | B: {names[1]} | B ÷ A |", "|---|---|---|---|"]
    for label, field, form in ROWS:
        values = [_value(run, field) for run in (a, b)]
        shown = ["–" if v is None else form.format(v) for v in values]
        ratio = f"{values[1] / values[0]:.3g}" if values[0] and values[1] is not None else "–"
        lines.append(f"| {label} | {shown[0]} | {shown[1]} | {ratio} |")
    lines += ["", "controller: the loader's controller process (under central loading the one that decodes and "
                  "ships every pixel, veRL's driver); driver: the trainer's driver process. Peaks: the largest "
                  "of the averaged steps."]
    lines += ["", "| step | A: step s, exposed s (share) | B: step s, exposed s (share) |", "|---|---|---|"]
    b_steps = {row["step"]: row for row in b["per_step"]}
    for row in a["per_step"]:
        other = b_steps.get(row["step"])
        lines.append(f"| {row['step']} | {_step_cell(row)} | {_step_cell(other) if other else '–'} |")
    check = report["same_samples"]
    if check is None:
        lines += ["", "samples: not compared (a run saved no rollouts: flexrl.trainer.save_rollouts)"]
    elif check["differing"]:
        lines += ["", f"samples: {check['differing']} of {check['compared']} differ (steps "
                      f"{check['differing_steps']}): the runs did not train on the same responses"]
    else:
        lines += ["", f"samples: the same {check['compared']} (prompt and response tokens) in both runs"]
    return "\n".join(lines)


def _step_cell(row: dict[str, float]) -> str:
    return f"{row['step_s']:.2f}, {row['exposed_s']:.3f} ({row['exposed_share']:.2%})"
