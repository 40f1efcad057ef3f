"""`flexrl bench trl-peer`: TRL's `GRPOTrainer` as a peer of `flexrl train`, on the same model
folder, records, prompts per step, samples per prompt, response length and run config (issue 40).

TRL is not a dependency of the project: it is imported here only, when the bench runs (`pip install
trl==1.16.0`, or on the GPU machine the wheels of scripts/fetch-trl-wheels.sh). The peer is what a
TRL user writes: `GRPOTrainer(model=<folder>, reward_funcs=[...], args=GRPOConfig(...),
train_dataset=<datasets.Dataset>)`, with
- the dataset's image records as conversational prompts (one user message, an image block at each
  `<image>` marker, as our processing renders it) and their `images`; TRL's GRPOTrainer takes no
  videos, so video records are left out (said in the report);
- the records in our loader's order (media/bad_records.py `EpochOrder` with the run config's loader
  seed), TRL's shuffling off, so that step s trains on the prompts ours trains on at step s;
- our built-in reward of the run config (`flexrl.rl.reward_fn`, rl/rewards.py) on the decoded
  completions and the records' fields;
- vLLM in colocate mode where vLLM imports (TRL 1.16.0 accepts vLLM 0.22-0.31; 0.26 is carried),
  else HF generate; `--rollout` forces either;
- one optimizer step per step: `prompts x samples` completions per generation, split into
  micro-batches of `micro_batch` completions (gradient accumulation).
Each step is timed between the trainer's step ends, its peak device memory read from torch and
from the device's own count (vLLM's pool too), its tokens counted as `flexrl train` counts them
(bench/trl_peer_report.py). The report lists what differs from our run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from flexrl_ds.bench.trl_peer_report import (OurSettings, StepFigures, differences, format_table, grpo_arguments,
                                             result_json, step_figures)
from flexrl_ds.common import RunInputError
from flexrl_ds.common.output_files import output_file
from flexrl_ds.config.flexrl_config import load_run_config
from flexrl_ds.media.bad_records import EpochOrder
from flexrl_ds.media.records import read_dataset
from flexrl_ds.media.types import BadRecord, Record
from flexrl_ds.models.processing import MARKER
from flexrl_ds.parallel import device
from flexrl_ds.rl.rewards import REWARDS

log = logging.getLogger(__name__)

TRL_VERSION = "1.16.0"
INSTALL_HINT = (f"pip install trl=={TRL_VERSION} (on the GPU machine: bash scripts/fetch-trl-wheels.sh here, "
                "carry .trl and run its install line there)")


@dataclass
class TrlPeerConfig:
    """What `flexrl bench trl-peer` runs."""

    model: str
    """Model folder (HF weights, tokenizer and processor files), as the GPU runner builds it."""
    data: str
    """The dataset file (train.jsonl of `flexrl make-dataset`); its image records are used."""
    run_config: str | None = None
    """Our run config (ds_configs/*.json): optimizer, clip, KL, checkpointing, sampling, reward and
    loader order copied from it; None: `OurSettings`' defaults."""
    prompts_per_step: int | None = None
    """Prompts per step; None: the run config's `flexrl.data.loader.global_batch` (else 4)."""
    samples_per_prompt: int | None = None
    """Completions per prompt (TRL's `num_generations`); None: the run config's `num_samples_per_prompt`."""
    response_length: int | None = None
    """Most tokens per completion (TRL's `max_completion_length`); None: the run config's
    `flexrl.rollout.max_response_length`."""
    steps: int = 2
    """Optimizer steps to run."""
    learning_rate: float | None = None
    """None: the run config's optimizer lr."""
    rollout: str = "auto"
    """vllm (colocate) | hf (generate) | auto: vllm where it imports and a GPU is there."""
    micro_batch: int | None = None
    """Completions per forward/backward; None: `samples_per_prompt` (must divide a step's completions)."""
    dtype: str = "bfloat16"
    """The model's load dtype in TRL (`model_init_kwargs`): bfloat16 | float32."""
    seed: int = 0
    """TRL's seed (sampling, dropout off anyway)."""
    work_dir: str = "/tmp/flexrl-trl-peer"
    """TRL's output_dir (nothing is saved there: no checkpoints)."""
    extra_args: dict[str, Any] = field(default_factory=dict)
    """More GRPOConfig keywords, applied last (tests: e.g. `use_cpu`)."""


def import_trl():
    """The `trl` module, or a one-line error saying how to install it."""
    try:
        import trl  # lazy: an optional package, not a dependency of the project
    except ModuleNotFoundError as error:
        raise RunInputError(f"bench trl-peer: TRL is not installed ({error.name} missing): {INSTALL_HINT}") from None
    if trl.__version__ != TRL_VERSION:
        log.warning("bench trl-peer: TRL %s is installed; the peer was written against %s", trl.__version__,
                    TRL_VERSION)
    return trl


def vllm_importable() -> bool:
    """Whether vLLM imports here (TRL's own check, which also says when the version is outside its range)."""
    from trl.import_utils import is_vllm_available  # lazy: TRL is optional

    return is_vllm_available()


def peer_records(data: str, ours: OurSettings, config: TrlPeerConfig) -> tuple[list[Record], int]:
    """The records of each step in our loader's order, image records only, and how many video
    records were left out of that order."""
    rows = [r for r in read_dataset(data) if not isinstance(r, BadRecord)]
    if not rows:
        raise RunInputError(f"bench trl-peer: {data} has no usable record")
    order = EpochOrder(len(rows), ours.loader_seed, ours.loader_shuffle)
    chosen: list[Record] = []
    dropped = 0
    for _ in range(config.steps):
        for index in order.take(config.prompts_per_step):
            record = rows[index]
            if any(item.kind != "image" for item in record.items):
                dropped += 1
            else:
                chosen.append(record)
    usable = len(chosen) // config.prompts_per_step * config.prompts_per_step
    if usable < config.prompts_per_step * config.steps:
        raise RunInputError(
            f"bench trl-peer: {data}: {len(chosen)} image record(s) in our order for {config.steps} step(s) of "
            f"{config.prompts_per_step} prompts ({dropped} with videos, which TRL's GRPOTrainer cannot take): "
            "make the data with `flexrl make-dataset --mix only-image`")
    return chosen, dropped


def trl_dataset(records: list[Record]):
    """A `datasets.Dataset` of conversational prompts with images, and the records' fields for the reward."""
    import datasets  # lazy: TRL's dependency, optional here
    from PIL import Image

    rows = []
    for record in records:
        parts, pieces = [], MARKER.split(record.prompt)
        for index, piece in enumerate(pieces):
            if index % 2 == 0:
                if piece:
                    parts.append({"type": "text", "text": piece})
            else:
                parts.append({"type": "image", "text": None})
        images = [Image.open(item.path).convert("RGB") for item in record.items]
        rows.append({"prompt": [{"role": "user", "content": parts}], "images": images, "record_id": record.id})
    return datasets.Dataset.from_list(rows)


def reward_fields(record: Record) -> dict[str, Any]:
    """A record's fields as our reward functions get them (runtime/data_controller.py `record_fields`,
    which imports Ray: the peer needs none)."""
    fields = {"id": record.id, "prompt": record.prompt, "answer": record.answer,
              "data_source": record.data_source, **record.extra}
    images = [str(item.path) for item in record.items if item.kind == "image"]
    return {**fields, "images": images} if images else fields


class StepLog:
    """What the reward function and the trainer's callbacks saw, per step."""

    def __init__(self, records: list[Record], reward_fn: str, tokenizer):
        if reward_fn not in REWARDS:
            raise RunInputError(f"bench trl-peer: flexrl.rl.reward_fn {reward_fn!r} is not a built-in "
                                f"({', '.join(REWARDS)}): the peer scores with our built-ins only")
        self.fields = {record.id: reward_fields(record) for record in records}
        self.reward = REWARDS[reward_fn]
        self.tokenizer = tokenizer
        self.lengths: list[list[int]] = [[]]
        self.rewards: list[list[float]] = [[]]
        self.record_ids: list[list[str]] = [[]]

    def __call__(self, prompts, completions, completion_ids, record_id, **_) -> list[float]:
        """TRL's reward-function signature: our built-in on the completions' text."""
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
        scores = self.reward(texts, [self.fields[name] for name in record_id])
        self.lengths[-1] += [len(ids) for ids in completion_ids]
        self.rewards[-1] += list(scores)
        self.record_ids[-1] += list(record_id)
        return list(scores)

    def next_step(self) -> None:
        self.lengths.append([])
        self.rewards.append([])
        self.record_ids.append([])


def figures_callback(step_log: StepLog, info: device.DeviceInfo, figures: list[StepFigures]):
    """A `transformers.TrainerCallback`: a step's time and memory peaks at its end, its figures at
    the log that follows (TRL's `num_tokens`, the prompt and completion tokens seen so far, and its
    `completions/mean_length`)."""
    from transformers import TrainerCallback  # lazy: transformers loads with TRL only

    monitor = device.DeviceUsageMonitor(info)

    class StepFiguresCallback(TrainerCallback):
        def __init__(self) -> None:
            self.started = time.perf_counter()
            self.tokens_before = 0.0
            self.ended: tuple[int, float, tuple[int, int]] | None = None
            """(step, seconds, (peak allocated, peak in use)) of the step whose log is awaited."""

        def _restart(self) -> None:
            device.reset_peak_memory(info)
            monitor.reset()
            self.started = time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            self._restart()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.started
            self.ended = (state.global_step, seconds, (device.max_memory_allocated(info), monitor.peak_bytes()))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if self.ended is None or not logs or "num_tokens" not in logs:
                return
            (step, seconds, peaks), self.ended = self.ended, None
            tokens = float(logs["num_tokens"])
            figures.append(step_figures(step, seconds, step_log.lengths[-1], step_log.rewards[-1],
                                        self.tokens_before, tokens, logs, peaks))
            self.tokens_before = tokens
            step_log.next_step()
            self._restart()

    return StepFiguresCallback()


def run_trl_peer(config: TrlPeerConfig, processing_class=None) -> dict[str, Any]:
    """Run the peer; returns the result JSON (setup, steps, differences). `processing_class`: TRL's
    (None: it loads the model folder's with AutoProcessor, which needs torchvision)."""
    import_trl()
    from trl import GRPOConfig, GRPOTrainer  # lazy: TRL is optional

    ours = OurSettings()
    if config.run_config:
        run = load_run_config(config.run_config)
        ours = OurSettings.from_run_config(run.deepspeed, run.flexrl)
    config = replace(config, prompts_per_step=config.prompts_per_step or ours.global_batch,
                     samples_per_prompt=config.samples_per_prompt or ours.num_samples_per_prompt,
                     response_length=config.response_length or ours.max_response_length)
    use_vllm = _use_vllm(config.rollout)
    records, dropped = peer_records(config.data, ours, config)
    completions = config.prompts_per_step * config.samples_per_prompt
    micro = config.micro_batch or config.samples_per_prompt
    if completions % micro:
        raise ValueError(f"--micro-batch {micro}: must divide a step's {completions} completions")
    info = device.detect()
    arguments = {**grpo_arguments(ours, config.learning_rate, use_vllm, vision_token_ids(config.model)),
                 "output_dir": config.work_dir, "max_steps": config.steps, "per_device_train_batch_size": micro,
                 "gradient_accumulation_steps": completions // micro, "num_generations": config.samples_per_prompt,
                 "max_completion_length": config.response_length, "shuffle_dataset": False,
                 "bf16": config.dtype == "bfloat16" and info.is_gpu, "model_init_kwargs": {"dtype": config.dtype},
                 "logging_steps": 1, "save_strategy": "no", "report_to": "none", "seed": config.seed,
                 "log_completions": False, "disable_tqdm": True, **config.extra_args}
    started = time.perf_counter()
    trainer_args = GRPOConfig(**arguments)
    from transformers import AutoTokenizer  # lazy: with TRL only

    step_log = StepLog(records, ours.reward_fn, AutoTokenizer.from_pretrained(config.model))
    step_log.__name__ = ours.reward_fn  # type: ignore[attr-defined]  # TRL names the reward in its logs
    figures: list[StepFigures] = []
    trainer = GRPOTrainer(model=config.model, reward_funcs=[step_log], args=trainer_args,
                          train_dataset=trl_dataset(records), processing_class=processing_class,
                          callbacks=[figures_callback(step_log, info, figures)])
    setup_s = time.perf_counter() - started
    trainer.train()
    setup = {**asdict(config), "trl_version": import_trl().__version__,
             "rollout": "vllm-colocate" if use_vllm else "hf-generate",
             "setup_s": setup_s, "device": device.accelerator_name() or "cpu",
             "ours": asdict(ours), "trl_args": {k: v for k, v in arguments.items() if _plain(v)},
             "record_ids": step_log.record_ids[:-1], "dropped_video_records": dropped}
    return result_json(figures, setup, differences(ours, use_vllm, config.dtype, micro, dropped))


def vision_token_ids(model: str) -> list[int]:
    """The model's vision placeholder and marker tokens, as `flexrl train` suppresses them
    (trainer/launch.py `vision_token_ids`)."""
    from transformers import AutoConfig  # lazy: with TRL only

    config = AutoConfig.from_pretrained(model)
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return [int(getattr(config, name)) for name in names if getattr(config, name, None) is not None]


def _use_vllm(rollout: str) -> bool:
    if rollout not in ("auto", "vllm", "hf"):
        raise ValueError(f"--rollout {rollout!r}: choose auto, vllm or hf")
    if rollout == "hf":
        return False
    available = device.gpu_available() and vllm_importable()
    if rollout == "vllm" and not available:
        raise RunInputError("bench trl-peer: --rollout vllm needs a GPU and vLLM 0.22-0.31 (TRL 1.16's range)")
    return available


def _plain(value: Any) -> bool:
    return isinstance(value, (str, int, float, bool, type(None), list, tuple, dict))


def write_result(result: dict[str, Any], json_path: str | None, text_path: str | None) -> str:
    """The table and the differences as text; the JSON and the text written where asked."""
    import json

    steps = [StepFigures(**row) for row in result["steps"]]
    setup = result["setup"]
    text = "\n".join([
        f"TRL {setup['trl_version']} GRPOTrainer, {setup['rollout']}, {setup['prompts_per_step']} prompts x "
        f"{setup['samples_per_prompt']} samples, <= {setup['response_length']} tokens, setup {setup['setup_s']:.1f} s "
        f"on {setup['device']}",
        format_table(steps), "", "What differs from flexrl train with the same run config:",
        *[f"- {line}" for line in result["differences"]]])
    if json_path:
        output_file(json_path).write_text(json.dumps(result, indent=1))
    if text_path:
        output_file(text_path).write_text(text + "\n")
    return text
