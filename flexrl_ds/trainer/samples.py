"""A GRPO step's prompts and samples as the driver holds them: token ids and metadata, no pixels.

- `encode_prompts`: the step's prompts as token ids (chat template, one pad per merged vision
  token) with shape-only vision items whose `share_key` is the prompt's name, so the n samples of a
  prompt encode its pixels once per step (models/vision_balance.py).
- `sample_seed`: the sampling seed of one sample, a function of (run seed, step, slot, sample
  index) only, so a resumed run, or another split over engines, draws the same responses.
- `StepSamples`: the rollouts of a step: per sample its prompt, response ids, reward and advantage;
  `encoded()` gives the `EncodedSample`s (prompt + response) the planner and the ranks use.
- `split_mini_batches` / `split_domains`: a step's samples over its optimizer steps, and a pass's
  samples over the SP domains (data-parallel replicas; each domain gets its own plan).
- `sequence_token_limit` / `too_long_prompts`: the prompts whose samples could outgrow what the
  planner may give a sequence under `flexrl.sp.max_tokens_per_rank`, found before the rollout.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from flexrl_ds.loader.metastore import PromptKey, SampleId
from flexrl_ds.models.processing import EncodedSample, VisionItem
from flexrl_ds.planning.planner import PlannerOptions, allowed_degrees, degree_cap
from flexrl_ds.runtime.data_controller import ControllerStep, prompt_name, sample_name

if TYPE_CHECKING:
    from flexrl_ds.media.types import Record, SampleMeta
    from flexrl_ds.models.processing import SampleEncoder
    from flexrl_ds.planning.config import SPConfig
    from flexrl_ds.planning.cost_model import CostModel


@dataclass
class PromptInputs:
    """One prompt of a step, encoded."""

    key: PromptKey
    """(step, slot)."""
    name: str
    """`prompt_name(key)`, e.g. "s3p1"."""
    record: Record
    """The dataset `Record`."""
    prompt_ids: list[int]
    """Chat-rendered prompt with expanded vision pads."""
    items: list[VisionItem]
    """Vision items with shape-only placeholders (share_key = name)."""
    sample_names: list[str]
    """Its n samples' ids, e.g. ["s3p1k0", "s3p1k1"]."""


def placeholder_items(meta: SampleMeta, share_key: str) -> list[VisionItem]:
    """VisionItems of a probed sample: shape-only placeholders, shared by the prompt's samples."""
    return [VisionItem.from_meta(item, meta.item_placeholder(index), share_key=f"{share_key}/{index}")
            for index, item in enumerate(meta.items)]


def encode_prompts(encoder: SampleEncoder, step: ControllerStep) -> list[PromptInputs]:
    """The step's prompts as token ids (the driver's tokenizer; metadata only)."""
    out = []
    for prompt in step.prompts:
        name = prompt_name(prompt.key)
        items = placeholder_items(prompt.meta, name)
        ids = encoder.encode_prompt(prompt.record.id, prompt.record.prompt, items)
        out.append(PromptInputs(prompt.key, name, prompt.record, ids, items,
                                [sample_name(sample) for sample in step.sample_ids(prompt)]))
    return out


@dataclass(frozen=True)
class SequenceLimit:
    """What one sequence may hold under `flexrl.sp.max_tokens_per_rank` (`planner.apply_oversize`)."""

    tokens: int
    """The cap × `degree`."""
    degree: int
    """The largest degree the planner may give a sequence."""
    bound_by: str
    """What sets `degree`: "p_max", "world_size" (the SP domain), "num_heads" or "head_rule"."""

    def explained(self, cap: int) -> str:
        """The limit with the settings that make it and the ones a user can change."""
        lever = {"p_max": "flexrl.sp.p_max", "world_size": "flexrl.sp.domain_size"}.get(self.bound_by)
        allows = f"that {lever} allows" if lever else "the model's query heads allow"
        settings = "flexrl.sp.max_tokens_per_rank" + (f" or {lever}" if lever else "")
        return (f"flexrl.sp.max_tokens_per_rank {cap} x degree {self.degree}, the largest {allows}; raise "
                f"{settings}, or lower flexrl.rollout.max_response_length")


def sequence_token_limit(sp: SPConfig, cost: CostModel, domain_size: int) -> SequenceLimit | None:
    """What a sequence may hold under `sp.max_tokens_per_rank`; None without that cap."""
    if sp.max_tokens_per_rank is None:
        return None
    allowed = allowed_degrees(domain_size, sp, cost, PlannerOptions().head_rule)
    cap = degree_cap(domain_size, sp, cost, allowed)
    return SequenceLimit(sp.max_tokens_per_rank * allowed[-1], allowed[-1], cap["by"])


def too_long_prompts(prompts: Sequence[PromptInputs], max_new_tokens: int, limit: int) -> dict[str, str]:
    """Prompt name -> why its samples cannot be trained: prompt tokens + the longest response
    `max_new_tokens` may exceed `limit` (`sequence_token_limit`)."""
    return {p.name: f"{len(p.prompt_ids)} prompt tokens + up to {max_new_tokens} response tokens may exceed "
                    f"the {limit} tokens a sequence may hold" for p in prompts
            if len(p.prompt_ids) + max_new_tokens > limit}


def sample_seed(run_seed: int, sample: SampleId) -> int:
    """A 63-bit sampling seed that depends only on (run seed, step, slot, sample index)."""
    text = f"flexrl/{run_seed}/{sample.step}/{sample.slot}/{sample.sample_index}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 1


def parse_sample_name(name: str) -> SampleId:
    """Inverse of `sample_name` ("s3p1k0" -> SampleId(3, 1, 0))."""
    step, rest = name[1:].split("p", 1)
    slot, index = rest.split("k", 1)
    return SampleId(int(step), int(slot), int(index))


@dataclass
class StepSamples:
    """The rollouts of one step, in sample order (prompt-major)."""

    prompts: list[PromptInputs]
    """The prompts that got responses."""
    response_ids: dict[str, list[int]]
    """Sample name -> generated token ids (EOS included when generation stopped there)."""
    engine_logprobs: dict[str, list[float]] = field(default_factory=dict)
    """Sample name -> the engine's log-prob of each generated token."""
    finish_reasons: dict[str, str] = field(default_factory=dict)
    """Sample name -> "stop" (EOS) or "length" (max_response_length)."""
    rewards: dict[str, float] = field(default_factory=dict)
    advantages: dict[str, float] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [name for prompt in self.prompts for name in prompt.sample_names if name in self.response_ids]

    def prompt_of(self) -> dict[str, PromptInputs]:
        return {name: prompt for prompt in self.prompts for name in prompt.sample_names}

    def encoded(self, names: Sequence[str] | None = None) -> dict[str, EncodedSample]:
        """EncodedSample (prompt + response, placeholders for pixels) per sample name."""
        prompts = self.prompt_of()
        out = {}
        for name in (self.names if names is None else names):
            prompt = prompts[name]
            ids = torch.tensor(prompt.prompt_ids + self.response_ids[name], dtype=torch.long)
            out[name] = EncodedSample(name, ids, len(prompt.prompt_ids), prompt.items)
        return out

    def prompt_keys(self) -> dict[str, PromptKey]:
        """Sample name -> its prompt's key (where its pixels live)."""
        return {name: prompt.key for prompt in self.prompts for name in prompt.sample_names}


def split_mini_batches(prompts: Sequence[PromptInputs], names: Sequence[str], num: int) -> list[list[str]]:
    """`names` in `num` mini-batches of whole prompt groups (contiguous prompts, sizes within one
    prompt of each other); groups are never split, so every mini-batch holds complete groups."""
    present = set(names)
    groups = [[n for n in prompt.sample_names if n in present] for prompt in prompts]
    groups = [group for group in groups if group]
    if num > len(groups):
        raise ValueError(f"flexrl.rl.mini_batches_per_step = {num} exceeds the {len(groups)} prompts of the step")
    batches, start = [], 0
    for index in range(num):
        stop = start + len(groups) // num + (1 if index < len(groups) % num else 0)
        batches.append([name for group in groups[start:stop] for name in group])
        start = stop
    return batches


def split_domains(prompts: Sequence[PromptInputs], names: Sequence[str], num_domains: int,
                  weight: Callable[[str], float]) -> list[list[str]]:
    """`names` over `num_domains` SP domains, each share planned on its own (data-parallel replicas).

    Whole prompt groups (a prompt's media then stays in one domain and is encoded once) when there
    are at least `num_domains` groups, else single samples; heaviest first onto the lightest domain
    (ties: the lower domain), `weight(name)` being a sample's cost. Every domain gets a sample where
    there are enough (the run config guarantees it for full steps; prompts set aside can leave
    fewer, and a domain without one idles: its plan has no sequence); each share keeps the order of `names`.
    """
    present = set(names)
    groups = [[n for n in prompt.sample_names if n in present] for prompt in prompts]
    units = [group for group in groups if group]
    if len(units) < num_domains:
        units = [[name] for group in units for name in group]
    loads, owner = [0.0] * num_domains, dict[str, int]()
    costs = [sum(weight(n) for n in unit) for unit in units]
    for index in sorted(range(len(units)), key=lambda i: (-costs[i], i)):
        domain = min(range(num_domains), key=lambda d: (loads[d], d))
        loads[domain] += costs[index]
        owner.update((name, domain) for name in units[index])
    return [[n for n in names if owner.get(n) == d] for d in range(num_domains)]


def media_of(prompt: PromptInputs) -> str:
    """What a prompt carries besides text: "text", "image", "video" or "image+video"."""
    kinds = sorted({item.kind for item in prompt.items})
    return "+".join(kinds) if kinds else "text"


@dataclass(frozen=True)
class LogprobGaps:
    """|engine log-prob - trainer log-prob| of the sampled tokens, per sample, and its means."""

    per_sample: dict[str, float]
    """Sample name -> mean over its response tokens."""
    mean: float
    """Over all the step's response tokens: near 0 only when the engine sampled with the policy's
    current weights (and the same model code)."""
    by_media: dict[str, float]
    """`media_of` its prompt -> mean over the response tokens of those samples (which inputs a gap
    comes from: e.g. the videos' mRoPE positions; docs/BENCHMARKS.md, "Engine agreement: vLLM
    against HF")."""


def logprob_gaps(samples: StepSamples, trainer_logprobs: dict[str, list[float]]) -> LogprobGaps:
    """The step's `LogprobGaps` (the engine's log-probs against the trainer's old-policy ones)."""
    prompts = samples.prompt_of()
    per_sample: dict[str, Any] = {}
    sums: dict[str, Any] = {}
    for name in samples.names:
        gaps = [abs(engine - trainer) for engine, trainer in zip(samples.engine_logprobs[name], trainer_logprobs[name])]
        per_sample[name] = sum(gaps) / max(len(gaps), 1)
        media = media_of(prompts[name])
        total, count = sums.get(media, (0.0, 0))
        sums[media] = (total + sum(gaps), count + len(gaps))
    all_total, all_count = sum(t for t, _ in sums.values()), sum(c for _, c in sums.values())
    return LogprobGaps(per_sample, all_total / max(all_count, 1),
                       {media: total / max(count, 1) for media, (total, count) in sorted(sums.items())})
