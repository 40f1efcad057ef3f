"""Loading HF model directories: with their weights (`load_model`), or only their structure
(`model_without_weights`: every parameter on the meta device, no weight file opened)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import transformers


def model_class(config) -> Any:
    """AutoModelForImageTextToText for VLMs (a config with a vision_config), AutoModelForCausalLM else."""
    if getattr(config, "vision_config", None) is not None:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def load_model(model_dir: str, dtype: str = "float32"):
    """The HF model of a directory: AutoModelForImageTextToText for VLMs, AutoModelForCausalLM else."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    return model_class(config).from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()


def model_without_weights(model_dir: str, dtype: str = "float32"):
    """The model `load_model` would give, built from the directory's config alone: its parameters
    (names, shapes, dtypes, ties as `load_model`'s) live on the meta device, with no storage, and no
    weight file is opened. Buffers are real: each module's constructor computes them as in a normal
    build (rotary `inv_freq`: non-persistent, never in the weight files nor in a weight sync)."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    with parameters_on_meta():
        model = model_class(config).from_config(config, dtype=getattr(torch, dtype))
    return model.eval()


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get each parameter moved to the meta device as it is registered (its
    initialisation then costs nothing), while buffers stay where their constructors make them.
    Uses torch's public parameter-registration hook; a parameter already on meta (a tied weight
    registered a second time) is kept as it is, so ties survive."""
    def to_meta(module: torch.nn.Module, name: str, parameter: torch.nn.Parameter | None):
        if parameter is None or parameter.device.type == "meta":
            return None
        return torch.nn.Parameter(parameter.to("meta"), requires_grad=parameter.requires_grad)

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(to_meta)
    try:
        yield
    finally:
        handle.remove()


def ordinary_token_bound(hf_config) -> int:
    """Token ids below this are ordinary text: the first vision special token (image/video pad,
    vision start), or the vocabulary's size where the model has none. Random text for benchmarks
    is drawn below it, so that it holds no vision placeholders."""
    special = [getattr(hf_config, name, None) for name in ("image_token_id", "video_token_id", "vision_start_token_id")]
    return min([token for token in special if token is not None] or [hf_config.get_text_config().vocab_size])
