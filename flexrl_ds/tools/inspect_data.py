"""`flexrl inspect-data` (registered in cli/data.py): predicted, and with `materialize` actual,
vision shapes per record of a dataset."""

from __future__ import annotations

import json
import sys

from flexrl_ds.common.output_files import output_file
from flexrl_ds.loader.config import DataConfig
from flexrl_ds.media.dataset import probe_entries
from flexrl_ds.media.preprocess import SamplePreprocessor, collate
from flexrl_ds.media.types import BadMediaError, BadRecord, SampleMeta


def inspect_data(data: str, data_config: DataConfig, materialize: bool, as_json: bool, plot: str | None,
                 progress=None) -> int:
    """`flexrl inspect-data`: one line (or JSON object) per record, a summary, exit code 1 on any
    shape mismatch. `progress(done, total)` follows the probing."""
    preprocessor = SamplePreprocessor(data_config)
    entries = probe_entries(data, preprocessor, progress=progress)
    counts = {"ok": 0, "bad": 0, "mismatch": 0, "vision_tokens": 0}
    if plot:
        plot_vision_tokens(entries, plot)
    for entry in entries:
        result = inspect_entry(entry, preprocessor, materialize)
        counts["ok" if result["ok"] else "bad"] += 1
        counts["mismatch"] += bool(result["mismatch"])
        counts["vision_tokens"] += result["vision_tokens"] or 0
        print(json.dumps(result) if as_json else _text_line(result), flush=True)
    summary = (f"{len(entries)} records: {counts['ok']} ok, {counts['bad']} bad, "
               f"{counts['vision_tokens']} vision tokens"
               + (f", {counts['mismatch']} shape mismatches" if materialize else ""))
    print(summary, file=sys.stderr if as_json else sys.stdout)
    return 1 if counts["mismatch"] else 0


def inspect_entry(entry, preprocessor, materialize: bool) -> dict:
    """The `inspect-data --json` object of one probed entry (SampleMeta or BadRecord)."""
    if isinstance(entry, BadRecord):
        return {"id": entry.id, "ok": False, "reason": f"{entry.stage}: {entry.reason}",
                "vision_tokens": None, "predicted_shapes": None, "actual_shapes": None, "mismatch": None}
    predicted = {key: list(shape) for key, shape in entry.predicted_shapes().items()}
    result = {"id": entry.id, "ok": True, "reason": None, "vision_tokens": entry.vision_tokens,
              "predicted_shapes": predicted, "actual_shapes": None, "mismatch": None}
    if materialize:
        try:
            outputs = collate(entry, preprocessor.materialize(entry))
        except BadMediaError as error:
            result.update(ok=False, reason=f"materialize: {error.bad.reason}")
            return result
        actual = {key: list(value.shape) for key, value in outputs.items() if hasattr(value, "shape")}
        result["actual_shapes"] = actual
        result["mismatch"] = actual != predicted
    return result


def plot_vision_tokens(entries, path: str) -> None:
    """Histogram of vision tokens per good record, split by media kind (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[int]] = {}
    for entry in entries:
        if isinstance(entry, SampleMeta):
            kind = "video" if entry.num_frames else ("image" if entry.num_images else "text")
            groups.setdefault(kind, []).append(entry.vision_tokens)
    figure, axis = plt.subplots(figsize=(7, 4))
    if groups:
        axis.hist(list(groups.values()), bins=30, label=list(groups), stacked=True)
        axis.legend()
    axis.set_xlabel("vision tokens per record (predicted from metadata)")
    axis.set_ylabel("records")
    axis.set_title(f"{sum(map(len, groups.values()))} good records")
    figure.tight_layout()
    figure.savefig(output_file(path), dpi=100)
    plt.close(figure)
    print(f"wrote {path}", file=sys.stderr)


def _text_line(result: dict) -> str:
    if not result["ok"] and result["predicted_shapes"] is None:
        return f"{result['id']:<16} BAD  {result['reason']}"
    shapes = " ".join(f"{key}={'x'.join(map(str, shape))}" for key, shape in result["predicted_shapes"].items())
    line = f"{result['id']:<16} ok   {result['vision_tokens']:>7} vision tokens  {shapes}"
    if not result["ok"]:
        return f"{result['id']:<16} BAD  {result['reason']}  (predicted {shapes})"
    if result["actual_shapes"] is not None:
        line += "  MISMATCH actual " + json.dumps(result["actual_shapes"]) if result["mismatch"] else "  [actual: same]"
    return line
