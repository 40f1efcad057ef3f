"""`train_step` (models/policy_update.py) keeps its micro-batches' statistics on the device and reads
them once per step: its loss, metrics and gradients equal a plain per-token Python loop's over the
same forward outputs, and the only host sync it makes outside the engine is that one read."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch

from flexrl_ds.models import policy_update as pu
from flexrl_ds.models.flex_model import FlexUlyssesLM, build_step_batch, positions_fn
from flexrl_ds.models.loading import load_model
from flexrl_ds.models.sample_data import random_plan_for
from flexrl_ds.parallel.profiling import SyncCounter
from flexrl_ds.rl.config import GRPOConfig
from flexrl_ds.tools.logprobs import encode_dataset


class ReplayEngine:
    """What `train_step` needs of a DeepSpeed engine, answering each forward with outputs made beforehand
    (so that the forward's own work stays out of the sync count)."""

    def __init__(self, outputs):
        self.outputs = list(outputs)
        self.module = SimpleNamespace(last_router_stats=None)
        self.boundaries: list[bool] = []
        self.counter: SyncCounter | None = None
        self.syncs_at_backward: list[int] = []

    def __call__(self, batch, with_entropy=False, entropy_grad=True):
        assert with_entropy
        return self.outputs.pop(0)

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self.boundaries.append(is_boundary)

    def backward(self, loss) -> None:
        if self.counter is not None:
            self.syncs_at_backward.append(sum(self.counter.calls.values()))
        loss.backward()

    def step(self) -> None:
        pass

    def get_global_grad_norm(self):
        return None


def _micro_batches(tiny_assets):
    samples = encode_dataset(tiny_assets["vl"], tiny_assets["data"])
    model = load_model(tiny_assets["vl"])
    names = sorted(samples)
    batches = []
    for part in (names[: len(names) // 2], names[len(names) // 2:]):
        plan = random_plan_for({s: samples[s].length for s in part}, 1, 1, seed=len(part))
        batches.append(build_step_batch(model.config, plan, {s: samples[s] for s in part}, 0,
                                        positions=positions_fn(model)))
    return model, samples, batches


def _plain_loop_loss(outputs, batch, old, advantages, config: GRPOConfig, num_tokens: int):
    """token_mean PPO-clip loss minus the entropy bonus, and the metrics, token by token in Python."""
    loss, pg, entropy, clipped, k3, count = 0.0, 0.0, 0.0, 0, 0.0, 0
    for position in range(batch.response_mask.numel()):
        if not batch.response_mask[position]:
            continue
        log_ratio = outputs.logprobs[position] - old[position]
        ratio, advantage = torch.exp(log_ratio), float(advantages[position])
        unclipped = ratio * advantage
        clipped_value = ratio.clamp(1 - config.eps_clip_low, 1 + config.eps_clip_high) * advantage
        token_pg = -torch.minimum(unclipped, clipped_value) / num_tokens
        token_entropy = outputs.entropy[position] / num_tokens
        loss = loss + token_pg - config.entropy_coef * token_entropy
        pg += float(token_pg.detach())
        entropy += float(token_entropy.detach())
        clipped += int(clipped_value < unclipped)
        k3 += math.expm1(float(log_ratio)) - float(log_ratio)
        count += 1
    return loss, {"pg_loss": pg, "entropy": entropy, "clip_count": clipped, "approx_kl_sum": k3, "num_tokens": count}


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01])
def test_train_step_reads_the_device_once_and_equals_a_plain_loop(tiny_assets, entropy_coef):
    base, samples, batches = _micro_batches(tiny_assets)
    config = GRPOConfig(entropy_coef=entropy_coef, init_kl_coef=0.0, eps_clip_low=0.05, eps_clip_high=0.05)
    denoms = pu.denominators({n: s.length - s.response_start for n, s in samples.items()})
    generator = torch.Generator().manual_seed(3)
    advantages = {name: float(torch.randn((), generator=generator)) for name in sorted(samples)}

    stepped, plain = copy.deepcopy(base), copy.deepcopy(base)
    step_module, plain_module = FlexUlyssesLM(stepped, logits_chunk=6), FlexUlyssesLM(plain, logits_chunk=6)
    outputs = [step_module(b, with_entropy=True, entropy_grad=entropy_coef > 0) for b in batches]
    inputs = []
    for batch, out in zip(batches, outputs):
        old = out.logprobs.detach() + 0.1 * torch.randn(out.logprobs.shape, generator=generator)
        inputs.append(pu.UpdateInputs(batch, old, None, pu.local_response_values(batch, advantages)))
    engine = ReplayEngine(outputs)
    with SyncCounter() as counter:
        engine.counter = counter
        result = pu.train_step(engine, inputs, config, denoms, keep_logprobs=True)
    # the step's statistics read once, the kept log-probs copied to the host: all after the last backward
    assert dict(counter.calls) == {"tolist": 1, "cpu": len(batches)} and engine.syncs_at_backward == [0, 0]
    assert engine.boundaries == [False, True]
    assert result.logprobs is not None
    for kept, out in zip(result.logprobs, outputs):
        assert kept.device.type == "cpu" and torch.equal(kept, out.logprobs.detach())

    expected_loss, expected = 0.0, dict.fromkeys(("pg_loss", "entropy", "clip_count", "approx_kl_sum", "num_tokens"), 0.0)
    for batch, item in zip(batches, inputs):
        out = plain_module(batch, with_entropy=True)
        loss, metrics = _plain_loop_loss(out, batch, item.old_logprobs, item.advantages, config, denoms.num_tokens)
        (loss + out.zero).backward()
        expected_loss += float(loss)
        expected = {key: expected[key] + metrics[key] for key in expected}
    assert expected["num_tokens"] == denoms.num_tokens and expected["clip_count"] > 0
    assert result.stats.loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-7)
    for key, value in expected.items():
        assert getattr(result.stats, key) == pytest.approx(value, rel=1e-5, abs=1e-7), key
    grads = dict(plain.named_parameters())
    for name, parameter in stepped.named_parameters():
        torch.testing.assert_close(parameter.grad, grads[name].grad, atol=1e-6, rtol=1e-4, msg=name)


def test_rank_grpo_loss_reads_its_sums_once(tiny_assets):
    """`rank_loss_and_sums` makes no host sync; `rank_grpo_loss` reads its statistics in one."""
    _, samples, batches = _micro_batches(tiny_assets)
    model = FlexUlyssesLM(load_model(tiny_assets["vl"]), logits_chunk=6)
    batch = batches[0]
    outputs = model(batch, with_entropy=True, entropy_grad=False)
    denoms = pu.denominators({n: s.length - s.response_start for n, s in samples.items()})
    advantages = pu.local_response_values(batch, dict.fromkeys(samples, 0.5))
    args = (outputs, batch, None, None, advantages, GRPOConfig(init_kl_coef=0.0), denoms, 1)
    with SyncCounter() as none:
        _, sums = pu.rank_loss_and_sums(*args)
    with SyncCounter() as once:
        _, stats = pu.rank_grpo_loss(*args)
    assert dict(none.calls) == {} and dict(once.calls) == {"tolist": 1}
    assert stats == pu.RankStats.from_sums(sums) and stats.num_tokens == int(batch.response_mask.sum())
