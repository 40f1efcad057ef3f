"""`flexrl bench loader` results as a table and as ShadowLoader / centralised ratios (no Ray)."""

from __future__ import annotations

from typing import Any

from flexrl_ds.bench.loader_bench_config import RunResult


def format_table(results: list[RunResult]) -> str:
    """One row per run. `call`/`return`: mean ms from sending the step call to the slowest worker
    entering it / from its compute end to the result arriving (see `step_phases`); `ready early`:
    worst-case ms the data was ready before the step needed it (negative: late)."""
    header = (f"{'mode':8} {'B':>4} {'K':>3} {'exposed ms/step':>16} {'worker wait ms':>15} {'ctrl loader ms':>15} "
              f"{'call ms':>8} {'return ms':>10} {'ready early ms':>15} "
              f"{'ctrl MB/step':>13} {'pixel MB/step':>14} {'cross-node MB/step':>19} {'ctrl RSS peak MB':>17} "
              f"{'total RSS MB':>13} {'samples/s':>10}")
    lines = [header]
    for r in results:
        phases = r.phases_ms
        margin = phases.get("ready_margin")
        lines.append(
            f"{r.mode:8} {r.global_batch:>4} {r.actors or '-':>3} {r.exposed_ms:>16.1f} {r.worker_wait_ms:>15.1f} "
            f"{r.controller_loader_ms:>15.1f} {phases.get('call', float('nan')):>8.1f} "
            f"{phases.get('return', float('nan')):>10.1f} {'-' if margin is None else f'{margin:.0f}':>15} "
            f"{r.controller_bytes_per_step / 2**20:>13.4f} "
            f"{r.pixel_bytes_per_step / 2**20:>14.1f} {r.cross_node_bytes_per_step / 2**20:>19.1f} "
            f"{r.controller_rss_peak_mb:>17.0f} {r.total_rss_peak_mb:>13.0f} "
            f"{r.samples_per_s:>10.2f}"
        )
    return "\n".join(lines)


def summary(results: list[RunResult]) -> dict[str, Any]:
    """ShadowLoader / centralised ratios per global batch (shadow run with the most actors)."""
    out = {}
    for batch in sorted({r.global_batch for r in results if r.mode != "none"}):
        central = next((r for r in results if r.mode == "central" and r.global_batch == batch), None)
        shadows = [r for r in results if r.mode == "shadow" and r.global_batch == batch]
        if central is None or not shadows:
            continue
        shadow = max(shadows, key=lambda r: r.actors)
        out[str(batch)] = {
            "exposed_ratio": shadow.exposed_ms / central.exposed_ms if central.exposed_ms else None,
            "controller_bytes_ratio": shadow.controller_bytes_per_step / central.controller_bytes_per_step,
            "controller_rss_growth_mb": {"central": central.controller_rss_peak_mb - central.controller_rss_start_mb,
                                         "shadow": shadow.controller_rss_peak_mb - shadow.controller_rss_start_mb},
        }
    return out
