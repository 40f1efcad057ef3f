"""The trainer's forward (FlexUlyssesLM with its vision exchange and response-row log-probs, and the
ZeRO-3 step loss; Qwen2.5-VL, and the Qwen3-VL MoE with its DeepStack rows and router) moves host tensors to the model's device only through `parallel.device.to_device`:
on a GPU a plain `.to(device)` from pageable host memory first waits for everything queued on the
device. Counted on the CPU, where the same calls are made: a `Tensor.to` naming a device, or a
`torch.tensor` / `torch.as_tensor` given one, called from flexrl_ds code other than
parallel/device.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

import flexrl_ds
from flexrl_ds.models.flex_model import FlexUlyssesLM, build_step_batch, positions_fn
from flexrl_ds.models.sample_data import random_plan_for
from flexrl_ds.models.zero3 import flex_step_loss

PACKAGE = Path(flexrl_ds.__file__).resolve().parent
DEVICE_MODULE = PACKAGE / "parallel" / "device.py"


def _names_a_device(args, kwargs) -> bool:
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, torch.Tensor)) or (isinstance(a, str) and a.split(":")[0] in
                                                                ("cpu", "cuda", "meta"))
               for a in args)


class DeviceCopyRecorder(TorchFunctionMode):
    """Records `file:line` of each device-naming `to` / `tensor` / `as_tensor` call made from a file
    under `root` (other than `exclude`)."""

    def __init__(self, root: Path, exclude: Path | None = None) -> None:
        super().__init__()
        self.root, self.exclude, self.calls = root, exclude, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        rest = args[1:] if name == "to" else ()
        if name in ("to", "tensor", "as_tensor") and _names_a_device(rest, kwargs):
            caller = Path(sys._getframe(1).f_code.co_filename).resolve()
            if caller.is_relative_to(self.root) and caller != self.exclude:
                self.calls.append(f"{caller.relative_to(self.root)}:{sys._getframe(1).f_lineno}")
        return func(*args, **kwargs)


def test_the_recorder_sees_a_plain_copy():
    recorder = DeviceCopyRecorder(Path(__file__).resolve().parent)
    with recorder:
        torch.ones(2).to(torch.device("cpu"))
        torch.ones(2).to(torch.float64)  # a dtype alone is no copy between devices
        torch.tensor([1, 2], device="cpu")
    assert len(recorder.calls) == 2, recorder.calls


@pytest.fixture(scope="module", params=["qwen2.5-vl", "qwen3-vl-moe"])
def model_and_samples(request, tmp_path_factory):
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.models.processing import encode_records
    from flexrl_ds.models.sample_data import write_scoring_dataset
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("copies")
    model_dir = make_tiny_model(TinyModelConfig(out_dir=str(root / "m"), arch=request.param, seed=3))
    data = write_scoring_dataset(root / "data", num_records=6, seed=4)
    return load_model(str(model_dir)), encode_records(model_dir, data)


def test_the_forward_and_loss_copy_through_to_device_only(model_and_samples):
    model, samples = model_and_samples
    plan = random_plan_for({s: x.length for s, x in samples.items()}, 1, 1, seed=0)
    batch = build_step_batch(model.config, plan, samples, 0, positions=positions_fn(model))
    assert batch.route is not None and batch.route.my_units  # the vision exchange runs
    flex = FlexUlyssesLM(model, logits_chunk=7)
    recorder = DeviceCopyRecorder(PACKAGE, exclude=DEVICE_MODULE)
    with recorder:
        loss, _, _ = flex_step_loss(flex, batch)
        loss.backward()
        flex(batch, with_entropy=True)
    assert recorder.calls == [], recorder.calls
