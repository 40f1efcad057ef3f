"""Loading HF model directories."""

from __future__ import annotations

import torch
import transformers


def load_model(model_dir: str, dtype: str = "float32"):
    """The HF model of a directory: AutoModelForImageTextToText for VLMs, AutoModelForCausalLM else."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    cls = transformers.AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None \
        else transformers.AutoModelForCausalLM
    return cls.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()

