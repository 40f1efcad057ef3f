"""Model inputs of records for a vision-language model or a text LM: token ids with expanded vision pads + pixel rows.

transformers' `Qwen2_5_VLProcessor` cannot be built where torchvision is missing (its video processor
requires it), so this module composes the same pieces: the model directory's tokenizer and chat
template (`SampleEncoder`), and the ShadowLoader's processor-equivalent preprocessing
(`flexrl_ds.media`: `read_dataset`, `SamplePreprocessor` configured from the model's processor JSON)
for the pixels (`encode_records`). Placeholder expansion follows the HF processor of the model's family
(`ModelFamily.expand_pads`, flexrl_ds/families/): for Qwen2.5-VL each rendered `<|image_pad|>` /
`<|video_pad|>` becomes `t*h*w / merge_size**2` copies; Qwen3-VL's videos become timestamped frame
groups. The response is tokenized separately and appended (its first token starts at `response_start`).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flexrl_ds.families import family_for
from flexrl_ds.families.base import TEXT
from flexrl_ds.planning.plan import SequenceSpec

from flexrl_ds.media.config import MediaConfig
from flexrl_ds.media.preprocess import SamplePreprocessor
from flexrl_ds.media.processor_files import has_processor_files, processor_settings
from flexrl_ds.media.records import read_dataset
from flexrl_ds.media.types import BadMediaError, BadRecord

MARKER = re.compile(r"<(image|video)>")
IMAGE, VIDEO = "image", "video"
TOKEN_TYPE = {IMAGE: 1, VIDEO: 2}


@dataclass
class VisionItem:
    """One image or video after patchify: what the vision tower encodes."""

    kind: str
    """'image' or 'video'."""
    pixel_values: torch.Tensor
    """(t*h*w, 3 * temporal_patch * patch**2) patch rows, Qwen2-VL order."""
    grid_thw: tuple[int, int, int]
    """(temporal groups, patch rows, patch columns)."""
    second_per_grid_t: float = 1.0
    """Seconds per temporal group (videos: temporal_patch_size / sampled fps)."""
    share_key: str | None = None
    """Items with the same key have identical pixels (e.g. "<prompt id>/<item index>" for the GRPO
    samples of one prompt): a step encodes them once. None: never shared."""
    frame_indices: tuple[int, ...] = ()
    """Video: the sampled frames' indices in the source file (Qwen3-VL's prompt timestamps, vLLM's metadata)."""
    source_fps: float | None = None
    """Video: the source file's frame rate."""

    @classmethod
    def from_meta(cls, meta_item, pixel_values, share_key: str | None = None) -> "VisionItem":
        """The item of a probed `ItemMeta` (media/types.py) with these pixel rows (or a placeholder)."""
        return cls(meta_item.kind, pixel_values, tuple(meta_item.grid_thw), meta_item.second_per_grid_t or 1.0,
                   share_key, tuple(meta_item.frame_indices), meta_item.info.fps)

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    def num_tokens(self, merge_size: int = 2) -> int:
        """Merged LLM tokens this item becomes."""
        return self.num_patches // (merge_size * merge_size)


@dataclass
class EncodedSample:
    """A record as model inputs: token ids of prompt + response and its vision items."""

    id: str
    input_ids: torch.Tensor
    """(L,) int64: chat-rendered prompt with expanded vision pads, then the response tokens."""
    response_start: int
    """Index of the first response token in `input_ids`."""
    items: list[VisionItem] = field(default_factory=list)
    """Vision items in prompt order (images and videos mixed)."""

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[0])

    def of_kind(self, kind: str) -> list[VisionItem]:
        return [item for item in self.items if item.kind == kind]

    def sequence_spec(self, seq_id: str | None = None) -> SequenceSpec:
        """What the planner sees of this sample: its length, vision tokens, images and frames."""
        return SequenceSpec(id=seq_id or self.id, tokens=self.length,
                            vision_tokens=sum(item.num_tokens() for item in self.items),
                            images=len(self.of_kind(IMAGE)),
                            frames=sum(item.grid_thw[0] * 2 for item in self.of_kind(VIDEO)))


class SampleEncoder:
    """Turns records into `EncodedSample`s with a model directory's tokenizer and processor files."""

    def __init__(self, model_dir: str | Path):
        import transformers

        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.has_vision = has_processor_files(model_dir)
        settings = processor_settings(model_dir) if self.has_vision else {}
        self.merge_size = int(settings.get("merge_size", 2))
        self.temporal_patch_size = int(settings.get("temporal_patch_size", 2))
        self.family = family_for(settings["processor_family"]) if self.has_vision else TEXT

    def encode_items(self, record_id: str, prompt: str, response: str, items: list[VisionItem]) -> EncodedSample:
        prompt_ids = self.encode_prompt(record_id, prompt, items)
        response_ids = self.tokenizer(response, add_special_tokens=False)["input_ids"]
        if not response_ids:
            raise ValueError(f"record {record_id!r}: empty response")
        input_ids = torch.tensor(prompt_ids + response_ids, dtype=torch.long)
        return EncodedSample(record_id, input_ids, len(prompt_ids), items)

    def encode_prompt(self, record_id: str, prompt: str, items: list[VisionItem]) -> list[int]:
        """Token ids of the chat-rendered prompt (generation prompt added), one pad per merged
        vision token of each item; `items` need only their kind and grid (placeholders do)."""
        parts, pieces = [], MARKER.split(prompt)
        for index, piece in enumerate(pieces):
            if index % 2 == 0:
                if piece:
                    parts.append({"type": "text", "text": piece})
            else:
                parts.append({"type": piece})
        messages = [{"role": "user", "content": parts}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        text = self.family.expand_pads(record_id, text, items, self.merge_size, self.temporal_patch_size)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_records(model_dir: str | Path, data_path: str | Path, log=None,
                   response_key: str = "response") -> dict[str, EncodedSample]:
    """EncodedSample per good record of a dataset file (file order); bad records are reported and skipped.

    Records need the text to score under `response_key` ("response", "answer", or any other field).
    Media go through the ShadowLoader's
    `SamplePreprocessor` with the geometry of the model's saved processor.
    """
    encoder = SampleEncoder(model_dir)
    preprocessor = SamplePreprocessor(MediaConfig().with_processor_dir(model_dir)) if encoder.has_vision else None
    samples: dict[str, EncodedSample] = {}
    skipped: list[str] = []
    for record in read_dataset(data_path):
        response = None if isinstance(record, BadRecord) else _field(record, response_key)
        if not isinstance(record, BadRecord) and not isinstance(response, str):
            record = BadRecord(record.id, no_text_to_score(response_key), record.index, "read")
        if not isinstance(record, BadRecord) and record.items and preprocessor is None:
            record = BadRecord(record.id, "has media but the model has no vision tower", record.index, "read")
        items: list[VisionItem] = []
        if not isinstance(record, BadRecord) and record.items:
            meta = preprocessor.probe(record)
            try:
                tensors = preprocessor.materialize(meta) if not isinstance(meta, BadRecord) else None
            except BadMediaError as error:
                meta = error.bad
            if isinstance(meta, BadRecord):
                record = meta
            else:
                items = [VisionItem.from_meta(item, tensors[index].pixel_values.float())
                         for index, item in enumerate(meta.items)]
        if isinstance(record, BadRecord):
            print(f"skipped record {record.id!r}: {record.reason}", file=log or sys.stderr)
            skipped.append(record.reason)
            continue
        samples[record.id] = encoder.encode_items(record.id, record.prompt, response, items)
    if not samples:
        raise ValueError(f"{data_path}: no usable records{missing_response_hint(skipped, response_key)}")
    return samples


def no_text_to_score(response_key: str) -> str:
    """The reason a record without text under `response_key` is skipped (one wording, for the hint)."""
    return f"no {response_key!r} text to score"


def missing_response_hint(reasons: list[str], response_key: str) -> str:
    """What to do when every record was skipped for want of text under `response_key` ("" otherwise)."""
    if not reasons or any(reason != no_text_to_score(response_key) for reason in reasons):
        return ""
    return (f": none has text under {response_key!r}; --response-key names the field holding the text to "
            "score (e.g. answer)")


def _field(record, key: str):
    """A record's text field: a named attribute (response, answer) or an extra column."""
    if key in ("response", "answer", "prompt", "data_source"):
        return getattr(record, key)
    return record.extra.get(key)
