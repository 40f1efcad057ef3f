"""Tiny random models (two text models with different weights, one Qwen2.5-VL) and vision prompts,
built once per test session (no hub, no downloads)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def rollout_assets(tmp_path_factory):
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("rollout_models")
    return {
        "q2": str(make_tiny_model(TinyModelConfig(out_dir=str(root / "q2"), arch="qwen2", seed=11))),
        "q2_other": str(make_tiny_model(TinyModelConfig(out_dir=str(root / "q2b"), arch="qwen2", seed=12))),
        "vl": str(make_tiny_model(TinyModelConfig(out_dir=str(root / "vl"), seed=11))),
    }


@pytest.fixture(scope="session")
def q2_engine(rollout_assets):
    from flexrl_ds.rollout.hf_engine import HFRolloutEngine

    return HFRolloutEngine(rollout_assets["q2"], device="cpu", max_batch_sequences=3)


@pytest.fixture(scope="session")
def tokenizer(rollout_assets):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(rollout_assets["q2"])


@pytest.fixture(scope="session")
def vl_prompts(rollout_assets):
    """Prompt ids and items per prompt (r0: one image, r1: one video, r2: two images and a video,
    r3: text only, r4: a video whose temporal positions reach past its spatial ones, where
    transformers 5.x's own rope index departs from the released rule), with random pixel rows: the
    engine takes patch rows, however they were made."""
    from flexrl_ds.models.processing import SampleEncoder, VisionItem

    generator = torch.Generator().manual_seed(0)

    def item(kind, grid, seconds=1.0):
        num_patches = grid[0] * grid[1] * grid[2]
        return VisionItem(kind, torch.randn(num_patches, 3 * 2 * 14 * 14, generator=generator), grid, seconds)

    media = {"r0": ("<image>\nwhat is the red ball?", [item("image", (1, 4, 6))]),
             "r1": ("<video>\nwho picked up the ball first?", [item("video", (2, 4, 4), 0.5)]),
             "r2": ("<image><image><video>\ncount the dogs", [item("image", (1, 6, 4)), item("image", (1, 4, 4)),
                                                               item("video", (3, 4, 6), 1.0)]),
             "r3": ("what is two and three?", []),
             "r4": ("<video>\nwhat happens last?", [item("video", (6, 4, 4), 1.0)])}
    encoder = SampleEncoder(rollout_assets["vl"])
    return {key: (encoder.encode_prompt(key, text, items), items) for key, (text, items) in media.items()}
