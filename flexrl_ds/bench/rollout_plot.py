"""The figure of a `flexrl bench rollout` result: every engine's tokens/s, warm and after sleep and wake,
and the batch's roofline floor where the result has one.

Drawn from the result's JSON (`RolloutBenchResult.to_json()`), so a saved result can be redrawn on
a machine without a GPU (`flexrl bench rollout --from-json R.json --plot R.png`).
"""

from __future__ import annotations

from typing import Any

from flexrl_ds.common.output_files import output_file

ENGINE_LABELS = {
    "hf": "hf generate, dynamic KV cache",
    "hf_static": "hf generate, static KV cache",
    "vllm": "vLLM, the trainer's engine",
    "vllm_seeding_off": "vLLM, seeding off",
    "vllm_raw": "bare LLM.generate",
}
"""Engine name in the result -> its label (an `_after_sleep` name is its engine after sleep and wake)."""


def engine_rows(result: dict[str, Any]) -> list[tuple[str, str, list[float], float]]:
    """(engine name, label, tokens/s of each timing, tokens/s of the best) per engine, in the
    result's order, warm before after-sleep."""
    rows = []
    for name, best in result["tokens_per_s"].items():
        tokens = best * result["seconds"][name]
        base = name.removesuffix("_after_sleep")
        label = ENGINE_LABELS.get(base, base) + (", after sleep and wake" if name != base else "")
        rows.append((name, label, [tokens / seconds for seconds in result["timings_s"][name]], best))
    return sorted(rows, key=lambda row: row[0].endswith("_after_sleep"))


def speedups(tokens_per_s: dict[str, float]) -> dict[str, tuple[str, float]]:
    """Engine -> (its hf baseline, tokens/s over the baseline's): engines timed warm against hf warm,
    engines timed after sleep and wake (`*_after_sleep`, the trainer's case) against hf after sleep
    and wake. Engines without their baseline in the result, and the baselines, are left out."""
    out = {}
    for name, rate in tokens_per_s.items():
        baseline = "hf_after_sleep" if name.endswith("_after_sleep") else "hf"
        if name != baseline and baseline in tokens_per_s:
            out[name] = (baseline, rate / tokens_per_s[baseline])
    return out


def floor_lines(result: dict[str, Any]) -> list[str]:
    """Each engine's best time against the batch's roofline floor (bench/rollout_floor.py), then the
    most any engine could gain over each hf baseline; none for a result without a floor."""
    floor = (result.get("floor_s") or {}).get("total")
    if not floor:
        return []
    lines = [f"{name} runs at {floor / seconds:.0%} of the roofline floor ({floor:.2f} s)"
             for name, seconds in result["seconds"].items()]
    return lines + [f"no engine can be more than {result['seconds'][name] / floor:.1f}x {name} on this batch and GPU"
                    for name in ("hf", "hf_after_sleep") if name in result["seconds"]]


def _floor_tokens_per_s(result: dict[str, Any]) -> float | None:
    floor = (result.get("floor_s") or {}).get("total")
    if not floor:
        return None
    name = next(iter(result["seconds"]))
    return result["tokens_per_s"][name] * result["seconds"][name] / floor


def plot_rollout(result: dict[str, Any], path: str) -> None:
    """Horizontal bars of each engine's best tokens/s, a dot per timing, the speedup over hf."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = engine_rows(result)
    ratios = speedups(result["tokens_per_s"])
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.6))
    for index, (name, _, rates, best) in enumerate(rows):
        color = "tab:gray" if name.startswith("hf") else "tab:blue"
        ax.barh(index, best, color=color, alpha=0.55 if name.endswith("_after_sleep") else 0.9, height=0.7)
        ax.plot(rates, [index] * len(rates), "k.", markersize=4)
        ratio = f"{ratios[name][1]:.1f}× {ratios[name][0].replace('_', ' ')}" if name in ratios else ""
        ax.text(best, index, f"  {best:,.0f}  {ratio}", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [label for _, label, _, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("generated tokens/s (bar: best timing; dots: every timing)")
    config = result.get("config", {})
    ceiling = _floor_tokens_per_s(result)
    if ceiling:
        ax.axvline(ceiling, color="tab:red", linestyle="--", linewidth=1)
        ax.text(ceiling, len(rows) - 0.4, " roofline limit", color="tab:red", fontsize=8, va="bottom")
    ax.set_xlim(0, max([best for *_, best in rows] + [ceiling or 0]) * 1.35)
    ax.set_title(f"flexrl bench rollout, {config.get('shape', '?')} shape, {config.get('prompts', '?')} × "
                 f"{config.get('prompt_len', '?')} → {config.get('new_tokens', '?')} tokens, "
                 f"{result.get('device', '?')}",
                 fontsize=10, loc="left")
    fig.tight_layout()
    fig.savefig(output_file(path), dpi=110)
    plt.close(fig)
