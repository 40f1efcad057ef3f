"""What every rollout engine takes and returns, and the registry of engine backends.

An engine is a plain class (no Ray inside; the trainer wraps it in a thin actor). It receives
`RolloutRequest`s (prompt token ids with expanded vision pads, the prompt's `VisionItem`s with real
pixels, a seed per sample) and returns one `RolloutResult` per request, in request order. A sample's
draws depend only on its seed, not on the other requests of the call, their order or the batch it
lands in, so a resumed run regenerates the same responses. (On a GPU the bf16 logits themselves may
depend on the batch's shape, so a token drawn near a boundary of its distribution can still flip:
rollout/sampling.py; vLLM with `seeding` "off" draws from its own stream.)

`engine_class(backend)` resolves `ROLLOUT_BACKENDS[backend]` lazily: asking for "hf" never imports
vLLM, and the vllm backend is only imported where it is asked for. Each backend's options
(`options_class(backend)`, a `BackendOptions`, in a light module of its own that imports no engine)
own what differs between backends: sleep level, the engine's keyword options, checks against the run
and its records, whether it needs GPUs. `RolloutConfig` reaches them through this registry, so
nothing outside a backend's own modules asks which backend runs.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Literal, NamedTuple, Protocol, Sequence

from flexrl_ds.common.json_files import read_json

if TYPE_CHECKING:
    import torch

    from flexrl_ds.models.processing import VisionItem
    from flexrl_ds.rollout.config import RolloutConfig

MAX_SEED = 2**63 - 1


class RolloutBackend(NamedTuple):
    """Where a backend's two classes live, as "module:Class" (imported on demand)."""

    engine: str
    """Its engine (a `RolloutEngine`)."""
    options: str
    """Its options (a `BackendOptions` dataclass): a light module, imported with the run config."""


ROLLOUT_BACKENDS = {
    "hf": RolloutBackend("flexrl_ds.rollout.hf_engine:HFRolloutEngine", "flexrl_ds.rollout.hf_options:HFOptions"),
    "vllm": RolloutBackend("flexrl_ds.rollout.vllm_engine:VLLMEngine", "flexrl_ds.rollout.vllm_options:VLLMOptions"),
}
"""Backend name (`flexrl.rollout.backend`) -> its engine and options classes. Adding a backend is one
line here, its engine module and its options module (docs/ARCHITECTURE.md)."""

SLEEP_LEVELS = (1, 2)
"""Every backend's `sleep_level` values: 1 keeps the engine's weights in host memory while it
sleeps, 2 frees them (the next weight sync writes every one)."""


def check_sleep_level(backend: str, level: int) -> None:
    """Refuse a sleep level other than SLEEP_LEVELS, naming the key `flexrl.rollout.<backend>.sleep_level`."""
    if level not in SLEEP_LEVELS:
        raise ValueError(f"flexrl.rollout.{backend}.sleep_level: 1 or 2, got {level}")


class BackendOptions:
    """What a backend's options (section `flexrl.rollout.<backend>`, a dataclass deriving from this)
    decide for a run. The defaults suit a backend with nothing special; override what differs."""

    needs_gpu: ClassVar[bool] = False
    """Whether the backend's engines run only on GPUs (a CPU machine refuses it before any worker starts)."""
    sleep_level: int
    """While the policy trains (colocated engines): 1 keeps the engine's weights in host memory, 2
    frees them (SLEEP_LEVELS). A dataclass field of every backend's options, checked by `check_sleep_level`."""

    def engine_options(self, rollout: RolloutConfig, skip_weights: bool) -> dict[str, Any]:
        """Keyword arguments of the engine beyond the common ones. `skip_weights`: the engine frees its
        weights as soon as it starts (`RolloutConfig.engines_drop_weights_at_start`), so it need not
        read the model directory's."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def starts_with_random_weights(self) -> bool:
        """Whether an engine starts with weights other than the model directory's, whatever the sleep level."""
        return False

    def logprob_diff_caveat(self, rollout: RolloutConfig) -> str | None:
        """Why the engines' log-probs differ from the trainer's even with the right weights, or None."""
        return None

    def check_placement(self, rollout: RolloutConfig, colocated: bool) -> None:
        """Refuse (ValueError naming the key) engines these options cannot run where the run puts them."""

    def resolved_for(self, records: Sequence[Any]) -> BackendOptions:
        """These options with what they derive from the run's records filled in (self if nothing),
        or a ValueError naming a record they cannot serve."""
        return self


def _token_ids(value: Any, where: str) -> list[int]:
    """An eos setting (an id, a list of ids or null) as a list of ids."""
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{where}: eos_token_id must be a token id or a list of them, got {value!r}")
    return list(values)


def stop_token_ids(tokenizer_eos: Any, model_dir: str | Path) -> tuple[int, ...]:
    """The ids that end a response: the tokenizer's eos id(s) and those of the model directory's
    `generation_config.json` (`eos_token_id`, an id or a list), in that order without repeats.

    Qwen2.5-VL-Instruct's tokenizer names `<|im_end|>` while its generation config lists
    `<|im_end|>` and `<|endoftext|>`; HF `generate` and vLLM stop on the union, and so must a
    rollout, or a response ending with the other id runs on to max_response_length."""
    ids = _token_ids(tokenizer_eos, "tokenizer")
    path = Path(model_dir) / "generation_config.json"
    if path.is_file():
        ids += _token_ids(read_json(path, "generation config").get("eos_token_id"), str(path))
    return tuple(dict.fromkeys(ids))


@dataclass(frozen=True)
class SamplingParams:
    """How one engine call samples: the same for every request of the call."""

    temperature: float = 1.0
    """Logits are divided by it before top-k / top-p; 0 means greedy decoding (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of most likely tokens whose probability reaches top_p; 1: off."""
    top_k: int = 0
    """Keep the k most likely tokens; 0: off."""
    max_new_tokens: int = 1024
    """Most tokens per response (finish_reason "length" when reached without an EOS)."""
    eos_token_ids: tuple[int, ...] = ()
    """A response stops after the first of these it samples (the EOS is kept in the response);
    empty: only `max_new_tokens` stops it."""
    suppressed_token_ids: tuple[int, ...] = ()
    """Tokens never sampled (their logits are set to -inf before any filtering): the vision
    placeholders and markers of a VLM, which a response must not contain (each would claim pixels)."""

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"sampling temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"sampling top_k: must be >= 0 (0: off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens: must be at least 1, got {self.max_new_tokens}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        object.__setattr__(self, "suppressed_token_ids", tuple(int(t) for t in self.suppressed_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_config(cls, config: "RolloutConfig", eos_token_ids: Iterable[int],
                    suppressed_token_ids: Iterable[int] = ()) -> "SamplingParams":
        """The sampling settings of `flexrl.rollout`, with the stop ids (`stop_token_ids`)."""
        return cls(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                   max_new_tokens=config.max_response_length, eos_token_ids=tuple(eos_token_ids),
                   suppressed_token_ids=tuple(suppressed_token_ids))


@dataclass
class RolloutRequest:
    """One sample to generate: a prompt (with its media) and the seed of this sample."""

    sample_key: str
    """Caller's id of the sample (e.g. "<record id>/<k>"), echoed in the result."""
    prompt_ids: list[int]
    """Prompt token ids, chat-rendered, with each vision pad expanded to its item's merged tokens."""
    items: "list[VisionItem]" = field(default_factory=list)
    """The prompt's images/videos in prompt order, with real pixel rows; empty for text prompts."""
    seed: int = 0
    """Seeds this sample's random draws, in [0, 2**63) (the trainer derives it from run seed, step, prompt
    and sample index: trainer/samples.sample_seed)."""

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"rollout request {self.sample_key!r}: empty prompt_ids")
        if not 0 <= int(self.seed) <= MAX_SEED:
            raise ValueError(f"rollout request {self.sample_key!r}: seed must be in [0, 2**63), got {self.seed}")
        for index, item in enumerate(self.items):
            if item.pixel_values.shape[0] != item.num_patches:
                raise ValueError(f"rollout request {self.sample_key!r}: {item.kind} {index} has "
                                 f"{item.pixel_values.shape[0]} pixel rows, its grid {tuple(item.grid_thw)} "
                                 f"makes {item.num_patches}")


@dataclass
class RolloutResult:
    """One generated response."""

    sample_key: str
    """The request's sample_key."""
    response_ids: list[int]
    """Sampled tokens, up to and including the first EOS (nothing after it: no padding)."""
    logprobs: list[float]
    """Per response token, the model's log-probability of it at the position that produced it:
    log_softmax of the logits divided by the sampling temperature (1 for greedy), before top-k /
    top-p filtering, as the trainer computes them. (vLLM at a temperature other than 1 returns its
    processed log-probs, which top-k / top-p also renormalise over the tokens they keep:
    rollout/vllm_inputs.py `logprobs_mode`.)"""
    finish_reason: Literal["stop", "length"]
    """"stop": ended with an EOS; "length": reached max_new_tokens without one."""


class RolloutEngine(Protocol):
    """What the trainer needs from an engine backend."""

    def generate(self, requests: Sequence[RolloutRequest], params: SamplingParams) -> list[RolloutResult]:
        """One result per request, in request order."""
        ...

    def load_weights(self, named_tensors: "Iterable[tuple[str, torch.Tensor]]") -> None:
        """Overwrite parameters; called with successive buckets, names as in the HF model's named_parameters()."""
        ...

    def reset_caches(self) -> None:
        """Drop whatever was computed with the previous weights (called after each weight sync)."""
        ...

    def sleep(self) -> None:
        """Free what the engine can while another model uses the device. Depending on the engine's
        sleep level its weights come back on wake, or must be written by a weight sync first."""
        ...

    def wake(self) -> None:
        """Undo sleep()."""
        ...


def check_backend(backend: str) -> None:
    """Refuse a backend name that is not registered, naming the key."""
    if backend not in ROLLOUT_BACKENDS:
        raise ValueError(f"flexrl.rollout.backend: {backend!r} is not one of {', '.join(ROLLOUT_BACKENDS)}")


def options_class(backend: str) -> type[BackendOptions]:
    """The options class of a backend name (its module imports no engine)."""
    check_backend(backend)
    module_name, class_name = ROLLOUT_BACKENDS[backend].options.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def engine_class(backend: str) -> type:
    """The engine class of a backend name, imported only now (vLLM is never imported for "hf")."""
    check_backend(backend)
    module_name, class_name = ROLLOUT_BACKENDS[backend].engine.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise ImportError(f"flexrl.rollout.backend {backend!r} needs {error.name!r}, which is not "
                              f"installed here") from error
        raise ImportError(f"flexrl.rollout.backend {backend!r} is not available in this version: "
                          f"{module_name} does not exist") from error
    return getattr(module, class_name)
