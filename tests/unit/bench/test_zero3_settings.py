"""bench/zero3_settings.py: DeepSpeed's persistence and granularity rules read off a module tree,
against hand-counted trees and against DeepSpeed 0.19.8's own code run on a tiny Qwen2.5-VL."""

from __future__ import annotations

import sys

import pytest
import torch

from flexrl_ds.bench import zero3_settings
from flexrl_ds.models.zero3 import persistent_elements, persistent_names


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(4)  # 8 elements
        self.linear = torch.nn.Linear(4, 4)  # 20 elements
        self.act = torch.nn.ReLU()  # none: not a layer


class Tree(torch.nn.Module):
    def __init__(self, head_out: int):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(4, head_out)


def test_granularity_by_hand():
    tree = Tree(head_out=100)  # head: 500 elements
    values = zero3_settings.granularities(tree)
    assert values["blocks.0"] == 28 // 3  # norm, linear, the block itself
    assert values["blocks"] == zero3_settings.NEVER  # a container
    assert values["blocks.0.linear"] == zero3_settings.NEVER  # a torch leaf
    assert values[""] == (2 * 28 + 500) // 8  # 2 x 3 layers, the head, the root
    assert zero3_settings.leaf_names(tree, 8) == []
    assert zero3_settings.leaf_names(tree, 9) == ["blocks.0", "blocks.1"]
    assert zero3_settings.leaf_names(tree, 69) == [""]  # parents first: the root takes everything
    assert zero3_settings.leaf_elements(tree, ["blocks.0", "blocks.1"]) == 28
    assert zero3_settings.layer_leaf_names(tree) == ["blocks.0", "blocks.1"]


def test_persistence_by_hand():
    tree = Tree(head_out=2)  # head: 10 elements; module order: 4, 4, 16, 4, (again), 8, 2
    assert persistent_elements(tree, 0) == 0
    assert persistent_elements(tree, 4) == 2 * (4 + 4 + 4) + 2  # norms and biases
    assert persistent_elements(tree, 10**15) == 2 * 28 + 10
    assert persistent_names(tree, 4, model_threshold=9) == ["blocks.0.norm.weight",
                                                                           "blocks.0.norm.bias"]


def test_equivalent_persistence_finds_the_same_parameters():
    real, small = Tree(head_out=100), Tree(head_out=200)
    threshold = zero3_settings.equivalent_persistence(real, 8, small)  # the norms and the blocks' biases
    assert persistent_names(small, threshold) == persistent_names(real, 8)
    assert len(persistent_names(small, threshold)) == 6
    with pytest.raises(ValueError, match="no threshold"):  # a whole head (4 x 1) persistent: not without the 4 x 4
        zero3_settings.equivalent_persistence(Tree(head_out=1), 4, Tree(head_out=100))


def _deepspeed_leaves(model: torch.nn.Module, threshold: int) -> list[str]:
    """DeepSpeed's own granularity pass and leaf choice (runtime/zero/parameter_offload.py), run on
    `model` without an engine."""
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.utils import z3_leaf_module

    for parameter in model.parameters():
        parameter.ds_numel = parameter.numel()
    offload = DeepSpeedZeRoOffload.__new__(DeepSpeedZeRoOffload)  # its two methods need only these fields
    offload.min_granularity_value, offload.min_granularity_layer = sys.maxsize, None
    offload.granularity_info, offload.z3_leaf_layers = set(), []
    offload._get_granularity_recursively(model)
    offload._set_leaf_by_threshold_preorder(model, threshold)
    return [name for name, module in model.named_modules() if z3_leaf_module(module)]


def test_leaf_choice_matches_deepspeeds_own(tmp_path):
    from flexrl_ds.models.loading import model_without_weights
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    directory = make_tiny_model(TinyModelConfig(out_dir=str(tmp_path / "vl"), num_hidden_layers=3, vision_depth=3),
                                weights=False)
    values = sorted({v for v in zero3_settings.granularities(model_without_weights(str(directory))).values()
                     if v != zero3_settings.NEVER})
    assert len(values) >= 4
    for threshold in [values[0] - 1, *values, values[-1] + 1]:
        ours = zero3_settings.leaf_names(model_without_weights(str(directory)), threshold)
        assert ours == _deepspeed_leaves(model_without_weights(str(directory)), threshold), threshold


def test_small_zero_settings_scale_volumes_defaults_included(tmp_path):
    """Element volumes, DeepSpeed's defaults among them, become as many decoder layers' worth of the
    small model; leaf layers are named; the granularity threshold is named out as leaves."""
    from flexrl_ds.models.loading import model_without_weights
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    def model(name: str, hidden: int):
        config = TinyModelConfig(out_dir=str(tmp_path / name), hidden_size=hidden, num_hidden_layers=3, vision_depth=2)
        return model_without_weights(str(make_tiny_model(config, weights=False)))

    real, small = model("real", 160), model("small", 80)
    ratio = (sum(p.numel() for p in small.model.language_model.layers[0].parameters())
             / sum(p.numel() for p in real.model.language_model.layers[0].parameters()))
    zero, leaves = zero3_settings.small_zero_settings(real, {"stage3_max_reuse_distance": 2e6}, small)
    assert zero["stage3_max_reuse_distance"] == int(2e6 * ratio)
    assert zero["stage3_prefetch_bucket_size"] == int(5e7 * ratio)  # DeepSpeed's default, scaled
    assert zero["stage3_max_live_parameters"] == int(1e9 * ratio)
    assert leaves == []
    _, leaves = zero3_settings.small_zero_settings(real, {zero3_settings.LAYER_LEAVES_KEY: 1}, small)
    assert len(leaves) == 3 + 2 and all(name.rsplit(".", 2)[-2] in ("layers", "blocks") for name in leaves)
    zero, leaves = zero3_settings.small_zero_settings(real, {"stage3_module_granularity_threshold": 10**9}, small)
    assert zero["stage3_module_granularity_threshold"] == 1 and leaves == zero3_settings.leaf_names(real, 10**9)
