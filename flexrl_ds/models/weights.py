"""ZeRO-3 parameters gathered in buckets (weight sync, HF export).

`iter_weight_buckets(module, bucket_bytes)` walks the HF model's parameters in `named_parameters()`
order and gathers them a bucket at a time with `deepspeed.zero.GatheredParameters` (one collective
per bucket, not per parameter), yielding full CPU copies named as in the HF model. Every rank of the
ZeRO-3 group must iterate it to the end (the gathers are collective); every rank receives the
tensors. Outside ZeRO-3 (plain parameters) it just copies. `save_hf_export` writes a directory that
`from_pretrained` loads: the model's config, safetensors weights and the tokenizer / processor files
of the directory the model came from.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TypeVar

import torch

MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
               "pytorch_model.bin")
"""Files of a model directory that an export replaces (everything else is copied: tokenizer, processor)."""

T = TypeVar("T")


def _is_partitioned(param: torch.nn.Parameter) -> bool:
    return hasattr(param, "ds_id")


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor, or of a ZeRO-3 parameter whole (not this rank's partition)."""
    numel = tensor.ds_numel if _is_partitioned(tensor) else tensor.numel()
    return int(numel) * tensor.element_size()


def _gathered(params: list[torch.nn.Parameter]):
    if any(_is_partitioned(p) for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()


def hf_module(module: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a DeepSpeed engine (`.module`) and/or a FlexUlyssesLM (`.hf_model`)."""
    for attribute in ("module", "hf_model"):
        inner = getattr(module, attribute, None)
        if isinstance(inner, torch.nn.Module):
            module = inner
    return module


def iter_weight_buckets(module: torch.nn.Module, bucket_bytes: int,
                        device: torch.device | str | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Successive buckets of (HF name, full tensor), each about `bucket_bytes` (collective).

    `module`: the HF model, or an engine / FlexUlyssesLM around it (names never carry their prefix).
    `device`: where the copies live; None: host memory (to send elsewhere). A colocated engine on the
    policy's GPU takes them on that GPU (no round trip through the host)."""
    target = torch.device("cpu") if device is None else torch.device(device)
    for bucket in group_by_bytes(hf_module(module).named_parameters(), tensor_bytes, bucket_bytes):
        yield _gather(bucket, target)


def join_weight_gathers(module: torch.nn.Module, bucket_bytes: int) -> None:
    """The collective part of `iter_weight_buckets` for a rank that keeps nothing (another rank sends
    or writes the weights): every bucket is gathered, in the same order, and nothing is copied."""
    for bucket in group_by_bytes(hf_module(module).named_parameters(), tensor_bytes, bucket_bytes):
        with _gathered([param for _, param in bucket]):
            pass


def group_by_bytes(named: Iterable[tuple[str, T]], nbytes: Callable[[T], int],
                   bucket_bytes: int) -> Iterator[list[tuple[str, T]]]:
    """`named` in order, cut into buckets: each closes once its `nbytes` reach `bucket_bytes` (the
    last one may be smaller)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, T]] = []
    size = 0
    for name, item in named:
        bucket.append((name, item))
        size += nbytes(item)
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _gather(bucket: list[tuple[str, torch.nn.Parameter]], device: torch.device) -> list[tuple[str, torch.Tensor]]:
    with _gathered([param for _, param in bucket]):
        return [(name, param.detach().to(device, copy=True)) for name, param in bucket]


def save_hf_export(module: torch.nn.Module, out_dir: str | Path, model_dir: str | Path, rank: int | None = None,
                   bucket_bytes: int = 512 * 2**20) -> None:
    """Write `module` (an HF model, ZeRO-3 partitioned or not; or an engine around it) as an HF
    directory at `out_dir`.

    Collective: every rank calls it; only rank 0 writes (`rank`: this process's rank; None: the
    torch.distributed rank, 0 without a process group). Non-weight files of `model_dir` (tokenizer,
    chat template, processor configs) are copied."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    module = hf_module(module)

    if rank != 0:
        join_weight_gathers(module, bucket_bytes)
        return
    state: dict[str, Any] = {}
    for bucket in iter_weight_buckets(module, bucket_bytes):
        state.update(bucket)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for path in Path(model_dir).iterdir():
        if path.is_file() and path.name not in MODEL_FILES:
            shutil.copy2(path, out / path.name)
    module.config.save_pretrained(out)
    if getattr(module, "generation_config", None) is not None:
        module.generation_config.save_pretrained(out)
    save_file(_untied(state, module), str(out / "model.safetensors"), metadata={"format": "pt"})


def _untied(state: dict[str, torch.Tensor], module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """safetensors refuses shared storage: tied weights are saved once (HF re-ties them on load)."""
    tied = getattr(module, "_tied_weights_keys", None) or {}
    names = tied if isinstance(tied, (list, tuple, set)) else list(tied)
    if getattr(module.config, "tie_word_embeddings", False):
        return {k: v for k, v in state.items() if k not in names}
    return {k: v.contiguous() for k, v in state.items()}
