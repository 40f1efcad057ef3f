"""`flexrl bench update` reports torch's pinned host memory beside what the memory estimate counts
for the engine's pinned gradient buffers (bench/update_bench.py `pinned_host_figures`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexrl_ds.bench import update_bench
from flexrl_ds.config.flexrl_config import load_run_config
from flexrl_ds.parallel.device import DeviceInfo

CONFIGS = Path(__file__).resolve().parents[3] / "ds_configs"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    return str(make_tiny_model(TinyModelConfig(out_dir=str(tmp_path_factory.mktemp("pinned") / "model"), seed=3)))


def test_nothing_is_reported_where_torch_keeps_no_pinned_statistics(tiny_model):
    cpu = DeviceInfo(kind="cpu", backend="gloo", deepspeed_accelerator="cpu")
    run = load_run_config(str(CONFIGS / "grpo_vl7b_1xh100.json"))
    assert update_bench.pinned_host_figures(cpu, run, tiny_model) == {}


@pytest.mark.parametrize("config, offloaded", [("grpo_vl7b_1xh100.json", True), ("grpo_tiny_cpu.json", False)])
def test_the_peak_stands_beside_the_estimates_pinned_gradient_buffers(monkeypatch, tiny_model, config, offloaded):
    from flexrl_ds.trainer.memory_estimate import pinned_block

    monkeypatch.setattr(update_bench.device_mod, "pinned_host_bytes", lambda info: {"current": 0, "peak": 3 << 30})
    figures = update_bench.pinned_host_figures(None, load_run_config(str(CONFIGS / config)), tiny_model)
    assert figures["peak"] == 3.0
    if offloaded:  # at least the flat bf16 gradient buffer of every parameter, held as a power-of-two block
        from flexrl_ds.models.loading import load_model

        params = sum(p.numel() for p in load_model(tiny_model).parameters())
        assert figures["estimate"] >= pinned_block(2 * params) / 2**30 > 0
    else:
        assert figures["estimate"] == 0
