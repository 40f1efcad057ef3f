"""`flexrl logprobs --loader shadow`, parent side: the whole file as one step of metadata, no pixels.

The parent runs the run's data controller (runtime/data_controller.py: a `LoaderService` actor
holding the `ProxyLoader` and its preprocessing actors); the actors probe the media headers (exact
grids, vision tokens) and decode every prompt once into per-slice objects in their own object
stores. This module adapts that to a scoring tool and turns the step into what the planner and
the ranks need:

1. `tool_data_config`: the run config's `flexrl.data` (`--config`; `loader.config.DataConfig`)
   adapted to a scoring tool: the whole file is one step in file order, without look-ahead, and
   bad records are skipped (as by `--loader local`) unless the policy is `error`;
2. `scorable`: records without text to score, or with media but no vision tower, become
   `BadRecord`s at stage read (as in the local path);
3. `load_step`: the step from the controller, tokenized here with the model's tokenizer
   (metadata-sized): `EncodedSample`s whose vision items hold shape-only `TensorPlaceholder`s where
   the local path holds pixel rows, keyed by record id, and each record's `PromptKey` (where the
   ranks pull its pixels with the controller's `PixelSource`).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

from flexrl_ds.config.flexrl_config import load_run_config
from flexrl_ds.loader.config import DataConfig
from flexrl_ds.loader.metastore import PromptKey
from flexrl_ds.media.processor_files import has_processor_files
from flexrl_ds.media.records import read_dataset
from flexrl_ds.media.types import BadRecord
from flexrl_ds.models.processing import SampleEncoder, VisionItem, _field, missing_response_hint, no_text_to_score

logger = logging.getLogger(__package__)


@dataclass
class ShadowSettings:
    """Overrides of `flexrl.data.pool` / `flexrl.data.loader` for `flexrl logprobs --loader shadow`."""

    num_actors_per_node: int | None = None
    """Preprocessing actors per Ray node (`--actors`); None: `flexrl.data.pool.num_actors_per_node`."""
    num_cpus_per_actor: float | None = None
    """Ray CPUs reserved per actor (`--cpus-per-actor`); None: `flexrl.data.pool.num_cpus_per_actor`."""
    groups_per_chunk: int = 1
    """Temporal patch groups per cached video slice. A rank pulls whole slices; vision balancing
    deals a video's groups out over the ranks one by one, so 1 (a slice per group) lets every rank
    pull exactly its groups, where larger chunks make ranks pull their neighbours' groups too."""
    timeout_s: float = 600.0
    """Longest wait for one probe, decode or fetch."""

    def __post_init__(self) -> None:
        if self.num_actors_per_node is not None and self.num_actors_per_node < 1:
            raise ValueError(f"--actors must be at least 1, got {self.num_actors_per_node}")
        if self.num_cpus_per_actor is not None and self.num_cpus_per_actor <= 0:
            raise ValueError(f"--cpus-per-actor must be positive, got {self.num_cpus_per_actor}")
        if self.groups_per_chunk < 1:
            raise ValueError(f"groups_per_chunk must be at least 1, got {self.groups_per_chunk}")


def tool_data_config(data_config: DataConfig, settings: ShadowSettings, num_records: int) -> DataConfig:
    """`data_config` adapted to a scoring tool: the whole file is one step in file order, without
    look-ahead; bad records are skipped (as by `--loader local`) unless the policy is `error`;
    `settings` override the pool."""
    policy = "error" if data_config.bad_record_policy == "error" else "skip"
    loader = dataclasses.replace(data_config.loader, global_batch=max(1, num_records), num_samples_per_prompt=1,
                                 shuffle=False, lookahead_steps=0, groups_per_chunk=settings.groups_per_chunk)
    pool = data_config.pool
    pool = dataclasses.replace(
        pool, timeout_s=settings.timeout_s,
        num_actors_per_node=settings.num_actors_per_node or pool.num_actors_per_node,
        num_cpus_per_actor=settings.num_cpus_per_actor or pool.num_cpus_per_actor)
    return dataclasses.replace(data_config, loader=loader, pool=pool, bad_record_policy=policy)


def scorable(records: list[Any], response_key: str, has_vision: bool) -> list[Any]:
    """Records with something to score (others become `BadRecord`s at stage read, as in the local path)."""
    out = []
    for record in records:
        if not isinstance(record, BadRecord):
            if not isinstance(_field(record, response_key), str):
                record = BadRecord(record.id, no_text_to_score(response_key), record.index, "read")
            elif record.items and not has_vision:
                record = BadRecord(record.id, "has media but the model has no vision tower", record.index, "read")
        out.append(record)
    return out


def placeholder_items(meta: Any) -> list[Any]:
    """VisionItems of a probed sample with shape-only placeholders instead of pixel rows."""
    return [VisionItem.from_meta(item, meta.item_placeholder(index)) for index, item in enumerate(meta.items)]


@dataclass
class ShadowStep:
    """The step as the parent holds it: metadata samples and where their pixels live."""

    step: Any
    """The controller's `ControllerStep` (prompts with their `SampleMeta`, the step's report)."""
    samples: dict[str, Any]
    """EncodedSample per record id, in file order; vision items hold `TensorPlaceholder`s."""
    prompt_keys: dict[str, PromptKey]
    """Record id -> its prompt's key (what the ranks ask the `PixelSource` for)."""
    bad_records: list[dict[str, str]] = field(default_factory=list)
    """Records skipped (read, probe, decode or missing response), with reasons."""


def load_step(controller: Any, encoder: Any, response_key: str, data_path: str) -> ShadowStep:
    """The controller's next step (probed and decoded on the actors), tokenized here."""
    step = controller.next_step()
    bad_records = list(step.report.get("bad_records", []))
    for bad in bad_records:
        logger.warning(f"skipped record {bad['id']!r}: {bad['reason']}")
    if not step.prompts:
        hint = missing_response_hint([bad["reason"] for bad in bad_records], response_key)
        raise ValueError(f"{data_path}: no usable records{hint}")
    samples, keys = {}, {}
    for prompt in step.prompts:
        record = prompt.record
        samples[prompt.meta.id] = encoder.encode_items(prompt.meta.id, record.prompt, _field(record, response_key),
                                                       placeholder_items(prompt.meta))
        keys[prompt.meta.id] = prompt.key
    return ShadowStep(step, samples, keys, bad_records)


def shadow_inputs(model_dir: str, data_path: str, response_key: str, settings: ShadowSettings,
                  run_config: str | None = None) -> tuple[DataConfig, Any, list[Any]]:
    """(the tool's `flexrl.data`, the model's `SampleEncoder`, the records to score). `run_config`:
    the DeepSpeed JSON whose `flexrl.data` configures the loader (None: defaults); the vision
    geometry always comes from the model's saved processor, as in `--loader local`."""
    data_config = DataConfig()
    if run_config:
        data_config = load_run_config(run_config).flexrl.data
    if has_processor_files(model_dir):
        data_config = data_config.with_processor_dir(model_dir)
    encoder = SampleEncoder(model_dir)
    records = scorable(read_dataset(data_path, data_config.media_root), response_key, encoder.has_vision)
    return tool_data_config(data_config, settings, len(records)), encoder, records
