"""`flexrl train` on CPU with the GRPO options of issue 39, every one set through `--set`.

Run F (3 steps, a checkpoint after step 1): dynamic sampling (a reward file gives half of the records
equal rewards, so groups are dropped), DAPO's overlong penalty, the KL in the reward with the adaptive
controller, token-level TIS, GSPO with sequence_mean and token-meaned KL/entropy, reinforce_baseline
with reward and advantage clips, 2 PPO epochs over 2 shuffled mini-batches. Each feature is checked
in what the run wrote, against an independent recomputation (the reward file on the saved text,
the documented formulas); run G resumes from F's step-1 checkpoint alone and must reproduce F's step
2. Run P (2 steps, the tiny config untouched) shows the old-policy pass skipped: one mini-batch, one
epoch, the update's own forward giving the old log-probs.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.ray, pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MAX_LEN, BUFFER, FACTOR, TARGET, HORIZON, PROMPTS = 16, 8, 0.5, 0.001, 50, 3
REWARD_FILE = '''
import hashlib


def equal_for_half(record_id):
    return sum(map(ord, record_id)) % 2 == 0


def score(responses, records):
    """Half of the records (by id) score 1.0 whatever the response; the others a hash of the text."""
    return [1.0 if equal_for_half(r["id"]) else int(hashlib.md5(text.encode()).hexdigest(), 16) % 7 / 7
            for text, r in zip(responses, records)]
'''
SETS = [
    "flexrl.rl.reward_fn=score.py:score", "flexrl.rl.dynamic_sampling=true", "flexrl.data.loader.global_batch=8",
    f"flexrl.rl.dynamic_sampling_prompts={PROMPTS}", "flexrl.rl.dynamic_sampling_max_rounds=8",
    f"flexrl.rl.overlong_buffer_length={BUFFER}", f"flexrl.rl.overlong_penalty_factor={FACTOR}",
    "flexrl.rl.kl_in_reward=true", "flexrl.rl.init_kl_coef=0.05", f"flexrl.rl.kl_target={TARGET}",
    f"flexrl.rl.kl_horizon={HORIZON}", "flexrl.rl.kl_estimator=k1", "flexrl.rl.tis_level=token",
    "flexrl.rl.tis_cap=1.5", "flexrl.rl.policy_loss=gspo", "flexrl.rl.loss_reduction=sequence_mean",
    "flexrl.rl.kl_entropy_reduction=token_mean", "flexrl.rl.advantage_estimator=reinforce_baseline",
    "flexrl.rl.reward_clip=5", "flexrl.rl.advantage_clip=3", "flexrl.rl.ppo_epochs=2",
    "flexrl.rl.mini_batches_per_step=2", "flexrl.rl.shuffle_mini_batches=true", "flexrl.rl.entropy_coef=0",
    "optimizer.params.lr=0.02", f"flexrl.rollout.max_response_length={MAX_LEN}",
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from flexrl_ds.bench.datasets import make_dataset
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("train_grpo")
    make_tiny_model(TinyModelConfig(out_dir=str(root / "model")))
    make_dataset(root / "data", "image-heavy", 12, "small", seed=1, task="keyword")
    (root / "score.py").write_text(REWARD_FILE)
    (root / "base.json").write_text((ROOT / "ds_configs" / "grpo_tiny_cpu.json").read_text())
    return root


def train(assets: Path, out: Path, max_steps: int, sets: list[str], resume: bool = False) -> int:
    from flexrl_ds.cli.main import main

    argv = ["train", "--config", str(assets / "base.json"), "--model", str(assets / "model"),
            "--data", str(assets / "data" / "train.jsonl"), "--out", str(out), "--max-steps", str(max_steps),
            "--set", "flexrl.trainer.save_every=2"]
    return main(argv + [arg for value in sets for arg in ("--set", value)] + (["--resume"] if resume else []))


@pytest.fixture(scope="module")
def run_f(assets, ray_session):
    out = assets / "run_f"
    assert train(assets, out, 3, SETS) == 0
    return out


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def rollouts(out: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (out / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]


def groups(samples: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for sample in samples:
        out.setdefault(sample["sample"].rsplit("k", 1)[0], []).append(sample)
    return out


def reward_module(assets: Path):
    namespace: dict = {}
    exec(REWARD_FILE, namespace)  # the file the run scored with
    return namespace


def test_set_values_reach_the_saved_config(run_f):
    saved = json.loads((run_f / "checkpoints" / "step_1" / "trainer_state.json").read_text())["run_config"]
    rl = saved["flexrl"]["rl"]
    assert (rl["policy_loss"], rl["tis_level"], rl["kl_target"], rl["ppo_epochs"]) == ("gspo", "token", TARGET, 2)
    assert rl["dynamic_sampling"] is True and rl["reward_fn"] == "score.py:score"
    assert saved["optimizer"]["params"]["lr"] == 0.02 and saved["flexrl"]["trainer"]["save_every"] == 2
    assert all(row["optimizer_steps"] == 4 for row in rows(run_f))  # 2 epochs x 2 mini-batches


def test_dynamic_sampling_trains_full_batches_of_unequal_groups(run_f):
    dropped = 0
    for step, row in enumerate(rows(run_f)):
        sampling, trained = row["dynamic_sampling"], groups(rollouts(run_f, step))
        assert len(trained) == sampling["groups_kept"] == PROMPTS
        for group in trained.values():  # the final rewards (the overlong penalty included) are what is compared
            assert len({s["reward"] for s in group}) > 1
        assert sampling["groups_rolled_out"] - sampling["groups_dropped"] >= PROMPTS
        assert row["zero_variance_groups"] == 0 and row["num_samples"] == PROMPTS * 4
        dropped += sampling["groups_dropped"]
    assert dropped > 0, "no group was dropped: the test did not exercise the filter"


def test_rewards_carry_the_overlong_penalty(run_f, assets):
    score = reward_module(assets)["score"]
    for step in range(3):
        samples = rollouts(run_f, step)
        base = score([s["response"] for s in samples], [{"id": s["id"]} for s in samples])
        for sample, expected in zip(samples, base):
            length = len(sample["response_ids"])
            penalty = -FACTOR * min(max(length - (MAX_LEN - BUFFER), 0), BUFFER) / BUFFER
            assert sample["overlong_penalty"] == pytest.approx(penalty)
            assert sample["reward"] == pytest.approx(expected + penalty)
        assert any(s["overlong_penalty"] < 0 for s in samples)


def test_kl_in_the_reward_not_in_the_loss_with_the_adaptive_coefficient(run_f):
    metrics = rows(run_f)
    coef = 0.05
    for step, row in enumerate(metrics):
        assert row["kl"] == 0.0 and row["kl_coef"] == pytest.approx(coef, rel=1e-9)
        samples = rollouts(run_f, step)
        # token t's advantage: the sample's + the sum of -kl_coef * k1 from t on, so at token 0 the whole KL reward
        kl_rewards = [s["token_advantages"][0] - s["advantage"] for s in samples]
        assert row["kl_reward_mean"] == pytest.approx(sum(kl_rewards) / len(kl_rewards), abs=1e-9)
        assert row["kl_reward_mean"] == pytest.approx(-coef * row["kl_k1"] * sum(len(s["response_ids"]) for s in samples)
                                                      / len(samples), rel=1e-6, abs=1e-12)
        error = min(max(row["kl_k1"] / TARGET - 1, -0.2), 0.2)
        coef *= 1 + error * row["num_samples"] / HORIZON
    assert metrics[0]["kl_k1"] == 0.0 and metrics[2]["kl_k1"] != 0.0  # the policy moved off the reference


def test_tis_and_lr_metrics(run_f):
    for row in rows(run_f):
        assert 0 < row["tis_weight_mean"] <= 1.5 and row["tis_weight_max"] > 0 and 0 <= row["tis_clipped_frac"] <= 1
        assert row["old_logprob_pass"] == "run" and row["rollout_logprob_diff"] < 1e-4
    # WarmupCosineLR (the config's: 2 linear warm-up steps from 0.1, cosine to 0.1 over 3 x 4 optimizer
    # steps), started at its iteration 0 when the engine is built (zero3.start_warmup): optimizer step k
    # runs at iteration k
    lrs = [row["lr"] for row in rows(run_f)]
    assert lrs[0] == pytest.approx(0.02 * 0.1)
    ratio = 0.1 + 0.9 * (1 + math.cos(math.pi * (4 - 2 + 1) / (12 - 2))) / 2  # optimizer step 4
    assert lrs[1] == pytest.approx(0.02 * ratio)


def test_resume_reproduces_the_next_step_with_every_feature_on(run_f, assets):
    out = assets / "run_g"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_f / "checkpoints" / "step_1", out / "checkpoints" / "step_1")
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(run_f)[:2]))
    assert train(assets, out, 3, SETS, resume=True) == 0
    a, b = rollouts(run_f, 2), rollouts(out, 2)
    assert [s["sample"] for s in a] == [s["sample"] for s in b]
    assert [s["response_ids"] for s in a] == [s["response_ids"] for s in b]
    row_a, row_b = rows(run_f)[2], rows(out)[2]
    for key in ("reward_mean", "loss", "pg_loss", "grad_norm", "kl_coef", "kl_k1", "lr", "tis_weight_mean"):
        assert row_b[key] == pytest.approx(row_a[key], rel=1e-4, abs=1e-6), key
    assert row_b["dynamic_sampling"] == row_a["dynamic_sampling"]
    from safetensors.torch import load_file

    weights_a = load_file(run_f / "hf" / "step_2" / "model.safetensors")
    weights_b = load_file(out / "hf" / "step_2" / "model.safetensors")
    for name in weights_a:
        torch.testing.assert_close(weights_b[name], weights_a[name], rtol=1e-5, atol=1e-6, msg=name)


def test_one_mini_batch_and_one_epoch_skip_the_old_policy_pass(assets, ray_session):
    out = assets / "run_p"
    assert train(assets, out, 2, []) == 0
    for step, row in enumerate(rows(out)):
        assert row["old_logprob_pass"] == "skipped" and "old" not in row["inference_time_s"]
        assert row["approx_kl"] == 0.0 and row["clip_frac"] == 0.0  # ratio 1 by construction
        assert row["rollout_logprob_diff"] < 1e-4  # the update's log-probs against the engine's
        assert max(s["logprob_diff"] for s in rollouts(out, step)) < 1e-4
