"""A weight sync that fails on one rank: the rank still joins every remaining bucket gather (they are
collective: the other ranks wait on them) and then raises, so the step fails at once rather than at
the group's timeout. Stand-ins for the gathers, the colocated engine and the weight channel."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flexrl_ds.trainer import policy_worker
from flexrl_ds.trainer.policy_worker import PolicyWorker

NUM_BUCKETS = 4


@pytest.fixture
def gathered(monkeypatch) -> list:
    """The indices of the bucket gathers that ran (a stand-in for models/weights.iter_weight_buckets)."""
    log: list = []

    def buckets(model, bucket_bytes, device):
        for index in range(NUM_BUCKETS):
            log.append(index)
            yield [(f"w{index}", torch.zeros(1))]

    monkeypatch.setattr(policy_worker.model_weights, "iter_weight_buckets", buckets)
    return log


def rank_of(index: int, **parts) -> PolicyWorker:
    stand_in = PolicyWorker.__new__(PolicyWorker)
    stand_in.rank, stand_in.device = index, None
    stand_in.device_info = SimpleNamespace(is_gpu=False)
    stand_in.policy = SimpleNamespace(module=SimpleNamespace(hf_model=None))
    for name, value in parts.items():
        setattr(stand_in, name, value)
    return stand_in


class FailingEngine:
    def __init__(self, fails_at: int, log: list | None = None):
        self.fails_at, self.loaded, self.reset, self.log = fails_at, 0, False, log if log is not None else []

    def load_weights(self, bucket):
        self.log.append("load")
        if self.loaded == self.fails_at:
            raise torch.OutOfMemoryError("CUDA out of memory")
        self.loaded += 1

    def reset_caches(self):
        self.reset = True


@pytest.mark.parametrize("fails_at", [None, 0, 2])
def test_a_failed_load_joins_every_gather_then_raises(gathered, fails_at):
    engine = FailingEngine(-1 if fails_at is None else fails_at)
    rank = rank_of(1, rollout=SimpleNamespace(engine=engine))
    if fails_at is None:
        assert rank.sync_rollout(1)["num_tensors"] == NUM_BUCKETS and engine.reset
        return
    with pytest.raises(RuntimeError, match="rank 1: the rollout engine failed to load the weights "
                                           r"\(OutOfMemoryError: CUDA out of memory\)"):
        rank.sync_rollout(1)
    assert gathered == list(range(NUM_BUCKETS)) and engine.loaded == fails_at and not engine.reset


@pytest.mark.parametrize("gpu", [True, False])
def test_torch_cache_goes_back_to_the_device_before_the_engine_wakes(gathered, monkeypatch, gpu):
    """A sleeping engine's weights come back outside torch's cache: on a GPU, blocks cached for the
    update leave first (an update that filled the H200 made the next wake run out of memory)."""
    log: list = []
    monkeypatch.setattr(policy_worker.device_mod, "release_cached_memory", lambda info: log.append("release"))
    rank = rank_of(0, rollout=SimpleNamespace(engine=FailingEngine(-1, log)), device_info=SimpleNamespace(is_gpu=gpu))
    rank.sync_rollout(1)
    assert log == (["release"] if gpu else []) + ["load"] * NUM_BUCKETS


def test_a_failed_channel_send_joins_every_gather_then_raises(gathered):
    def send_one_then_fail(stream):
        next(stream)
        raise ConnectionError("receiver gone")

    with pytest.raises(ConnectionError, match="receiver gone"):
        rank_of(0, channel=SimpleNamespace(send=send_one_then_fail)).send_weights(1)
    assert gathered == list(range(NUM_BUCKETS))
