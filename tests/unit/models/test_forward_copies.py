"""The trainer's passes move host tensors to the model's device only through `parallel.device.to_device`:
on a GPU a plain `.to(device)` from pageable host memory first waits for everything queued on the
device. Counted on the CPU, where the same calls are made, over FlexUlyssesLM's forward (vision
exchange, response-row log-probs), the trainer's `train_step` (GRPO and GSPO losses, the MoE router's
auxiliary loss) and their backward (checkpointed recomputation included): every `Tensor.to` naming a
device, and every `torch.tensor` / `torch.as_tensor` given one, called from flexrl_ds code other than
parallel/device.py. Qwen2.5-VL, and the Qwen3-VL MoE with its DeepStack rows and router."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import flexrl_ds
from flexrl_ds.models import flex_model
from flexrl_ds.models import policy_update as pu
from flexrl_ds.models.flex_model import FlexUlyssesLM, build_step_batch, positions_fn
from flexrl_ds.models.sample_data import random_plan_for
from flexrl_ds.rl.config import GRPOConfig

PACKAGE = Path(flexrl_ds.__file__).resolve().parent
DEVICE_MODULE = PACKAGE / "parallel" / "device.py"


def _names_a_device(args, kwargs) -> bool:
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (torch.device, torch.Tensor))
               or (isinstance(a, str) and a.split(":")[0] in ("cpu", "cuda", "meta")) for a in args)


class DeviceCopyRecorder:
    """While installed (`install(monkeypatch)`), records `file:line` of each device-naming `Tensor.to`,
    `torch.tensor` and `torch.as_tensor` call made from a file under `root` (other than `exclude`).
    The functions themselves are wrapped, not a torch function mode: `backward()` runs without modes."""

    def __init__(self, root: Path, exclude: Path | None = None) -> None:
        self.root, self.exclude, self.calls = root, exclude, []

    def _note(self) -> None:
        frame = sys._getframe(2)
        caller = Path(frame.f_code.co_filename).resolve()
        if caller.is_relative_to(self.root) and caller != self.exclude:
            self.calls.append(f"{caller.relative_to(self.root)}:{frame.f_lineno}")

    def install(self, monkeypatch) -> "DeviceCopyRecorder":
        plain_to, plain_tensor, plain_as_tensor = torch.Tensor.to, torch.tensor, torch.as_tensor

        def to(tensor, *args, **kwargs):
            if _names_a_device(args, kwargs):
                self._note()
            return plain_to(tensor, *args, **kwargs)

        def factory(plain):
            def make(*args, **kwargs):
                if kwargs.get("device") is not None:
                    self._note()
                return plain(*args, **kwargs)
            return make

        monkeypatch.setattr(torch.Tensor, "to", to)
        monkeypatch.setattr(torch, "tensor", factory(plain_tensor))
        monkeypatch.setattr(torch, "as_tensor", factory(plain_as_tensor))
        return self


class _CopiesInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad.to(torch.device("cpu")) * 2


def test_the_recorder_sees_plain_copies_in_forward_and_backward(monkeypatch):
    recorder = DeviceCopyRecorder(Path(__file__).resolve().parent).install(monkeypatch)
    torch.ones(2).to(torch.device("cpu"))
    torch.ones(2).to(torch.float64)  # a dtype alone is no copy between devices
    torch.tensor([1, 2], device="cpu")
    x = torch.ones(2, requires_grad=True)
    _CopiesInBackward.apply(x).sum().backward()
    assert len(recorder.calls) == 3, recorder.calls


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


class LiveEngine:
    """What `train_step` needs of a DeepSpeed engine, around a live FlexUlyssesLM."""

    def __init__(self, module: FlexUlyssesLM) -> None:
        self.module = module

    def __call__(self, batch, with_entropy=False, entropy_grad=True):
        return self.module(batch, with_entropy=with_entropy, entropy_grad=entropy_grad)

    def backward(self, loss) -> None:
        loss.backward()

    def step(self) -> None:
        pass

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        pass

    def get_global_grad_norm(self):
        return None


def _train_step(model, samples, config: GRPOConfig) -> None:
    plan = random_plan_for({s: x.length for s, x in samples.items()}, 1, 1, seed=0)
    batch = build_step_batch(model.config, plan, samples, 0, positions=positions_fn(model))
    assert batch.route is not None and batch.route.my_units  # the vision exchange runs
    denoms = pu.denominators({n: s.length - s.response_start for n, s in samples.items()})
    advantages = {name: 0.5 - index % 2 for index, name in enumerate(sorted(samples))}
    inputs = [pu.UpdateInputs(batch, None, None, pu.local_response_values(batch, advantages))]
    pu.train_step(LiveEngine(FlexUlyssesLM(model, logits_chunk=7)), inputs, config, denoms)


CONFIGS = {"ppo_clip": GRPOConfig(init_kl_coef=0.0, router_aux_loss_coef=0.01),
           "gspo": GRPOConfig(init_kl_coef=0.0, policy_loss="gspo", loss_reduction="sequence_mean")}


@pytest.mark.parametrize("loss", sorted(CONFIGS))
def test_the_update_copies_through_to_device_only(model_and_samples, loss, monkeypatch):
    model, samples = model_and_samples
    model.zero_grad(set_to_none=True)
    recorder = DeviceCopyRecorder(PACKAGE, exclude=DEVICE_MODULE).install(monkeypatch)
    _train_step(model, samples, CONFIGS[loss])
    assert any(p.grad is not None for p in model.parameters())  # the backward ran under the recorder
    assert recorder.calls == [], recorder.calls


def test_a_plain_copy_in_the_forward_would_be_seen(model_and_samples, monkeypatch):
    """The control: with `to_device` replaced by a plain `.to`, the forward's copies are recorded."""
    model, samples = model_and_samples
    recorder = DeviceCopyRecorder(PACKAGE, exclude=DEVICE_MODULE).install(monkeypatch)
    monkeypatch.setattr(flex_model, "to_device", torch.Tensor.to)  # the recorder's: called from flex_model.py
    _train_step(model, samples, CONFIGS["ppo_clip"])
    assert any(call.startswith("models/flex_model.py:") for call in recorder.calls), recorder.calls
