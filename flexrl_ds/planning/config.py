"""FlexUlysses planning settings (section `flexrl.sp` of a run config)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from flexrl_ds.common import is_power_of_two


@dataclass
class SPConfig:
    """FlexUlysses sequence-parallel planning (section `flexrl.sp`)."""

    p_max: int = 8
    """Largest Ulysses degree a sequence may get; a power of two, at most the SP domain size."""
    h_pack: int | None = None
    """Sequences shorter than this many tokens are packed together; None: the planner's default."""
    H_pack: int | None = None
    """Token budget of one pack of short sequences; None: the planner's default."""
    max_tokens_per_rank: int | None = None
    """Cap on the tokens one rank holds in one forward pass (activation memory); None: no cap.
    `flexrl train` sets aside, before their rollout, prompts whose samples could exceed it × the
    largest degree, and runs a pass whose samples together exceed it × the ranks as micro-batches
    (gradients accumulated into one optimizer step: planning/micro_batches.py). The planning tools
    and `flexrl logprobs` plan one pass and name what overflows."""
    logprob_max_tokens_per_rank: int | None = None
    """A looser cap for the no-grad log-prob passes (old policy, reference), which keep no layer's
    activations for a backward: at least `max_tokens_per_rank`, and only with it; None: the same cap
    (the passes are then planned once for both). With it, fewer log-prob passes are cut. `flexrl
    logprobs` plans under it; the planning tools (`flexrl plan`, `simulate`, `bench planner`) do not."""
    cost_model: str | None = None
    """A preset name (qwen2.5-vl-7b, qwen2.5-vl-32b, mimo-vl-7b) or the path of a HF config.json;
    None: the trained model's own config.json (`flexrl train`), qwen2.5-vl-7b for the planning tools."""
    calibration: str | None = "auto"
    """Path of a calibration JSON written by `flexrl bench sp --calibrate`; "auto": the shipped file
    (ds_configs/calibration/) matching the accelerator and model, if any (callers pass the device
    name to `load_cost_model`); None or "none": formula defaults."""
    domain_size: int | None = None
    """Ranks of one sequence-parallel domain; None: the whole world. In `flexrl train` it must divide
    the policy ranks: each domain is a data-parallel replica with its own plan per pass."""
    overlap: bool = True
    """Overlap pack j+1's all-to-all with pack j's attention (the executor's attention, and the
    planner's step-time model)."""
    oversize: str = "error"
    """What to do with a sequence that cannot fit at p_max under the token cap: error|drop|truncate."""
    logprob_chunk_bytes: int = 1 << 30
    """Byte budget of one LM-head chunk's [tokens x vocabulary] working set, forward and backward
    (models/logprob_chunks.py): the chunk holds as many tokens as fit it (1 GiB: 588 tokens over a
    151,936-row vocabulary in bf16). The policy's, the reference's and `flexrl logprobs`' passes."""

    def for_logprob_passes(self) -> "SPConfig":
        """These settings with the log-prob passes' cap in `max_tokens_per_rank`."""
        return replace(self, max_tokens_per_rank=self.logprob_max_tokens_per_rank or self.max_tokens_per_rank)

    def domain_ranks(self, num_ranks: int) -> int:
        """Ranks of one SP domain among `num_ranks` policy ranks: `domain_size`, or all of them."""
        return self.domain_size or num_ranks

    def __post_init__(self) -> None:
        if not is_power_of_two(self.p_max):
            raise ValueError(f"flexrl.sp.p_max: {self.p_max} is not a power of two")
        for name in ("h_pack", "H_pack", "max_tokens_per_rank", "logprob_max_tokens_per_rank", "domain_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"flexrl.sp.{name}: must be positive, got {value}")
        looser = self.logprob_max_tokens_per_rank
        if looser is not None and self.max_tokens_per_rank is None:
            raise ValueError(f"flexrl.sp.logprob_max_tokens_per_rank ({looser}) needs flexrl.sp.max_tokens_per_rank, "
                             "which it loosens for the log-prob passes")
        if looser is not None and looser < self.max_tokens_per_rank:
            raise ValueError(f"flexrl.sp.logprob_max_tokens_per_rank ({looser}) must be at least "
                             f"flexrl.sp.max_tokens_per_rank ({self.max_tokens_per_rank}), which it loosens")
        if self.h_pack is not None and self.H_pack is not None and self.h_pack > self.H_pack:
            raise ValueError(f"flexrl.sp.h_pack ({self.h_pack}) exceeds flexrl.sp.H_pack ({self.H_pack})")
        if self.logprob_chunk_bytes < 1:
            raise ValueError(f"flexrl.sp.logprob_chunk_bytes: must be positive, got {self.logprob_chunk_bytes}")
        if self.oversize not in ("error", "drop", "truncate"):
            raise ValueError(f"flexrl.sp.oversize: {self.oversize!r} is not one of error, drop, truncate")
