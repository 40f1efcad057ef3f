"""The `hf` rollout backend: batched HF `generate` with a KV cache (CPU, tests, fallback), dynamic
or static (`HFOptions.kv_cache`).

Requests that share one prompt (identical `prompt_ids` and items: the n GRPO samples of a prompt) form
a group of rows that needs no padding; groups (by prompt length) are packed whole into `generate` calls
of at most `max_batch_sequences` rows, shorter prompts left-padded (`pad_prompts=False`: one call per
group). The tests check that a padded batch gives the same tokens as prompts run alone. `generate`
runs greedily with `SeededSampler` as its logits processor: the sampler
draws each row's token from that row's seeded stream (temperature, top-k, top-p) and forces it, so a
sample's response depends only on its prompt, the weights, the sampling settings and its seed.

Vision-language models get the inputs the HF processor would give (`models.flex_model.reference_inputs`:
pixel_values / image_grid_thw, pixel_values_videos / video_grid_thw / second_per_grid_ts and
mm_token_type_ids, without which transformers 5.x silently falls back to 1D positions, and the mRoPE
position_ids of models/positions.py, which `generate` extends by one per new token), repeated once
per row of the call.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Sequence

import torch
import transformers

from flexrl_ds.models.flex_model import reference_inputs
from flexrl_ds.models.loading import load_model, model_without_weights
from flexrl_ds.models.processing import EncodedSample, VisionItem
from flexrl_ds.parallel import device as device_mod
from flexrl_ds.parallel.device import detect
from flexrl_ds.rollout.base import RolloutRequest, RolloutResult, SamplingParams
from flexrl_ds.rollout.hf_options import HFOptions
from flexrl_ds.rollout.sampling import SeededSampler


class HFRolloutEngine:
    """A full copy of the policy as an HF model, sampling with `generate` (see the module docstring)."""

    def __init__(self, model_dir: str | Path, dtype: str = "float32", device: str | torch.device | None = None,
                 max_batch_sequences: int = 64, pad_prompts: bool = True, model: torch.nn.Module | None = None,
                 kv_cache: str = HFOptions.kv_cache, sleep_level: int = HFOptions.sleep_level,
                 load_weights_at_start: bool = True):
        """pad_prompts: batch different prompts together, left-padded (else one call per prompt);
        model: an HF model already built from `model_dir`'s config (e.g. random weights made on the GPU
        by a benchmark) instead of loading the directory's weights; kv_cache, sleep_level: `HFOptions`
        (sleep_level 2, the default, needs a full weight sync between a sleep and the next wake);
        load_weights_at_start: False builds the model from `model_dir`'s config without reading its
        weights (models/loading.model_without_weights; buffers such as the rotary frequencies are
        computed as in a normal load): every weight starts as after a sleep at level 2, allocated on
        the device when `load_weights` writes it, and `wake` / `generate` are refused, naming the
        weights, until a weight sync has written all of them. The trainer starts its colocated
        engines so at sleep_level 2 (`RolloutConfig.engine_options`): they would free the
        directory's weights at their first sleep, and it syncs every weight before step 0."""
        HFOptions(kv_cache=kv_cache, sleep_level=sleep_level)  # the config's checks, for engines built without one
        if max_batch_sequences < 1:
            raise ValueError(f"max_batch_sequences: must be at least 1, got {max_batch_sequences}")
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"dtype: {dtype!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
        if not (Path(model_dir) / "config.json").is_file():
            raise ValueError(f"model_dir: {model_dir} is not a model directory (no config.json)")
        if model is not None and not load_weights_at_start:
            raise ValueError("load_weights_at_start=False builds the model from model_dir's config: pass no model")
        if sleep_level == 1 and not load_weights_at_start:
            raise ValueError("load_weights_at_start=False needs sleep_level 2: a weight sync writes the weights "
                             "on the device, where a sleep at level 1 keeps them in host memory")
        if device is None:
            device = detect().device(0)
        self.device = torch.device(device)
        self.max_batch_sequences = max_batch_sequences
        self.pad_prompts = pad_prompts
        self.kv_cache, self.sleep_level = kv_cache, sleep_level
        if model is None:
            build = load_model if load_weights_at_start else model_without_weights
            model = build(str(model_dir), dtype)
        self._shapes = {name: parameter.shape for name, parameter in model.named_parameters()}
        self._dropped: set[str] = set() if load_weights_at_start else set(self._shapes)
        """Weights freed by a sleep at level 2, or never loaded (`load_weights_at_start` False), and not
        written since."""
        self._dropped_by = "a sleep at level 2" if load_weights_at_start else "a start without weights"
        """What left the weights in `_dropped` unwritten (for the error that names them)."""
        if not load_weights_at_start:
            _empty_parameters_on(model, self.device)
        self.model = model.to(self.device)
        # A clean generation config: no sampling defaults or penalties carried over from the checkpoint.
        self.model.generation_config = transformers.GenerationConfig()
        text_config = self.model.config.get_text_config()
        self.pad_token_id = int(text_config.pad_token_id if text_config.pad_token_id is not None else 0)
        self.is_vision_language = getattr(self.model.config, "vision_config", None) is not None
        self._parameters = dict(self.model.named_parameters())
        self._asleep = False

    def generate(self, requests: Sequence[RolloutRequest], params: SamplingParams) -> list[RolloutResult]:
        """One result per request, in request order."""
        if self._asleep:
            raise RuntimeError("hf engine: generate while asleep (call wake first)")
        self._check_weights_written("generate")
        for request in requests:
            self._check_request(request)
        groups = group_requests(requests, self.max_batch_sequences)
        if self.pad_prompts:
            groups.sort(key=lambda group: len(requests[group[0]].prompt_ids))
            batches = pack_groups(groups, self.max_batch_sequences)
        else:
            batches = [[group] for group in groups]
        results: list[RolloutResult | None] = [None] * len(requests)
        for batch in batches:
            indices = [index for group in batch for index in group]
            rows = self._generate_batch([requests[group[0]] for group in batch], [len(g) for g in batch],
                                        [requests[index] for index in indices], params)
            for index, result in zip(indices, rows):
                results[index] = result
        assert all(result is not None for result in results)
        return results  # type: ignore[return-value]

    def _generate_batch(self, prompts: list[RolloutRequest], counts: list[int], rows: list[RolloutRequest],
                        params: SamplingParams) -> list[RolloutResult]:
        """One `generate` call: prompts[i] repeated counts[i] times (left-padded to the longest)."""
        inputs = self._batch_inputs(prompts, counts)
        sampler = SeededSampler([request.seed for request in rows], params)
        config = transformers.GenerationConfig(
            do_sample=False, num_beams=1, use_cache=True, max_new_tokens=params.max_new_tokens,
            eos_token_id=list(params.eos_token_ids) or None, pad_token_id=self.pad_token_id,
            **_cache_settings(self.kv_cache))
        with torch.no_grad():
            sequences = self.model.generate(**inputs, generation_config=config,
                                            logits_processor=transformers.LogitsProcessorList([sampler]))
        results = sampler.results(params.eos_token_ids)
        start = inputs["input_ids"].shape[1]
        for row, (tokens, _, _) in enumerate(results):
            assert sequences[row, start:start + len(tokens)].tolist() == tokens, "generate ignored the sampler"
        return [RolloutResult(request.sample_key, tokens, logprobs, reason)  # type: ignore[arg-type]
                for request, (tokens, logprobs, reason) in zip(rows, results)]

    def _batch_inputs(self, prompts: list[RolloutRequest], counts: list[int]) -> dict[str, torch.Tensor]:
        """Model inputs of the rows: token rows left-padded (attention_mask 0 there), media concatenated in
        row order, as the model scatters vision embeddings over the batch's pad tokens row by row."""
        per_prompt = []
        for prompt, count in zip(prompts, counts):
            sample = EncodedSample(prompt.sample_key, torch.tensor(prompt.prompt_ids, dtype=torch.long),
                                   len(prompt.prompt_ids), list(prompt.items))
            per_prompt.append({name: _repeat_rows(name, value, count)
                               for name, value in reference_inputs(self.model, sample).items()})
        length = max(len(prompt.prompt_ids) for prompt in prompts)
        batch: dict[str, list[torch.Tensor]] = {"attention_mask": []}
        for inputs in per_prompt:
            pad = length - inputs["input_ids"].shape[1]
            batch["attention_mask"].append(torch.nn.functional.pad(torch.ones_like(inputs["input_ids"]), (pad, 0)))
            for name, value in inputs.items():
                if name == "input_ids":
                    value = torch.nn.functional.pad(value, (pad, 0), value=self.pad_token_id)
                elif name in ("mm_token_type_ids", "position_ids"):  # (positions of pads: masked out)
                    value = torch.nn.functional.pad(value, (pad, 0), value=0)
                batch.setdefault(name, []).append(value)
        return {name: torch.cat(values, dim=1 if name == "position_ids" else 0).to(self.device)
                for name, values in batch.items()}

    def _check_request(self, request: RolloutRequest) -> None:
        if request.items and not self.is_vision_language:
            raise ValueError(f"rollout request {request.sample_key!r}: has media but the model has no vision tower")
        if not self.is_vision_language:
            return
        config = self.model.config
        merge = int(config.vision_config.spatial_merge_size)
        for kind, token_id in (("image", config.image_token_id), ("video", config.video_token_id)):
            expected = sum(item.num_tokens(merge) for item in request.items if item.kind == kind)
            found = sum(1 for token in request.prompt_ids if token == token_id)
            if expected != found:
                raise ValueError(f"rollout request {request.sample_key!r}: {found} {kind} pad tokens in "
                                 f"prompt_ids but its {kind} items make {expected}")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the parameters of those names (one bucket of a weight sync)."""
        with torch.no_grad():
            for name, tensor in named_tensors:
                parameter = self._parameters.get(name)
                if parameter is None:
                    raise ValueError(f"load_weights: {name!r} is not a parameter of the rollout model")
                if tuple(self._shapes[name]) != tuple(tensor.shape):
                    raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, "
                                     f"the rollout model's is {tuple(self._shapes[name])}")
                if name in self._dropped:  # freed by a level-2 sleep: allocated anew on the device
                    parameter.data = torch.empty(self._shapes[name], dtype=parameter.dtype, device=self.device)
                    self._dropped.discard(name)
                parameter.copy_(tensor.to(device=parameter.device, dtype=parameter.dtype))

    def reset_caches(self) -> None:
        """Nothing outlives a `generate` call here (the KV cache is per call)."""

    def sleep(self) -> None:
        """Free the accelerator for training. Level 1: the weights move to host memory (on a CPU
        there is nothing to free). Level 2: they are freed wherever they are, and each is allocated
        again when `load_weights` writes it. `load_weights` works while asleep; `generate` needs
        `wake` first."""
        self._asleep = True
        if self.sleep_level == 2:
            for name, parameter in self._parameters.items():
                parameter.data = torch.empty(0, dtype=parameter.dtype, device=parameter.device)
                self._dropped.add(name)
            self._dropped_by = "a sleep at level 2"
        elif self.device.type != "cpu":
            self.model.to("cpu")
        if self.device.type != "cpu":
            device_mod.release_cached_memory(detect())

    def wake(self) -> None:
        """Bring the weights back to the engine's device; after a level-2 sleep (or a start without
        weights) every weight must have been written since (a weight sync), else this raises naming them."""
        self._check_weights_written("wake")
        if self.sleep_level == 1 and self.device.type != "cpu":
            self.model.to(self.device)
        self._asleep = False

    def _check_weights_written(self, action: str) -> None:
        """Raise naming the weights freed (or never loaded) and not written since, if any."""
        if self._dropped:
            missing = sorted(self._dropped)
            raise RuntimeError(f"hf engine: {action} after {self._dropped_by} with {len(missing)} weights not "
                               f"written since (a weight sync must load every one): {', '.join(missing[:5])}"
                               + (", ..." if len(missing) > 5 else ""))


def _empty_parameters_on(model: torch.nn.Module, device: torch.device) -> None:
    """Each parameter (on the meta device: models/loading.model_without_weights) becomes an empty
    tensor on `device`, as a sleep at level 2 leaves it. The Parameter objects stay the same
    (`torch.utils.swap_tensors`), so tied weights stay tied."""
    for parameter in model.parameters():
        empty = torch.nn.Parameter(torch.empty(0, dtype=parameter.dtype, device=device),
                                   requires_grad=parameter.requires_grad)
        torch.utils.swap_tensors(parameter, empty)


def _cache_settings(kv_cache: str) -> dict:
    """GenerationConfig fields of a `HFOptions.kv_cache` mode (a static cache would otherwise be
    compiled on a GPU, again for every new batch shape)."""
    return {"cache_implementation": "static", "disable_compile": True} if kv_cache == "static" else {}


def _repeat_rows(name: str, value: torch.Tensor, count: int) -> torch.Tensor:
    """A one-prompt input repeated for `count` rows (position_ids (3, 1, L): along its batch axis 1;
    media tensors: concatenated copies, one per row)."""
    if name == "position_ids":
        return value.repeat(1, count, 1)
    return value.repeat(count, *[1] * (value.dim() - 1))


def group_requests(requests: Sequence[RolloutRequest], max_batch_sequences: int) -> list[list[int]]:
    """Request indices in batches of identical prompts (ids and items), each at most max_batch_sequences."""
    groups: list[list[int]] = []
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    for index, request in enumerate(requests):
        candidates = by_prompt.setdefault(tuple(request.prompt_ids), [])
        for group_index in candidates:
            group = groups[group_index]
            if len(group) < max_batch_sequences and same_items(requests[group[0]].items, request.items):
                group.append(index)
                break
        else:
            candidates.append(len(groups))
            groups.append([index])
    return groups


def pack_groups(groups: list[list[int]], max_batch_sequences: int) -> list[list[list[int]]]:
    """Consecutive groups packed into batches of at most max_batch_sequences rows (groups kept whole)."""
    batches: list[list[list[int]]] = []
    rows = 0
    for group in groups:
        if batches and rows + len(group) <= max_batch_sequences:
            batches[-1].append(group)
            rows += len(group)
        else:
            batches.append([group])
            rows = len(group)
    return batches


def same_items(left: Sequence[VisionItem], right: Sequence[VisionItem]) -> bool:
    """Whether two prompts' media are the same (equal share keys, or equal pixels)."""
    if len(left) != len(right):
        return False
    for a, b in zip(left, right):
        if (a.kind, tuple(a.grid_thw), a.second_per_grid_t) != (b.kind, tuple(b.grid_thw), b.second_per_grid_t):
            return False
        if a.share_key is not None and a.share_key == b.share_key:
            continue
        if a.pixel_values is not b.pixel_values and not torch.equal(a.pixel_values, b.pixel_values):
            return False
    return True
