"""`flexrl train` end to end on CPU: Ray + DeepSpeed ZeRO-3 (gloo) + ShadowLoader + FlexUlysses.

One run of 3 steps (A) serves the end-to-end checks; a second run (B) starts from A's step-1
checkpoint alone and must reproduce A's step 2: the same samples, responses, metrics and weights.
Every figure is checked against an independent recomputation (the reward function on the saved
response text, plain-Python group advantages, the engine's log-probs against the trainer's).
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
REQUIRED = ("step", "reward_mean", "reward_std", "loss", "pg_loss", "kl", "entropy", "clip_frac", "grad_norm",
            "response_length_mean", "num_samples", "time_s", "tokens_per_gpu_s", "attention_balance")
PHASES = ("data", "rollout", "reward", "inference", "update", "sync", "step")


def tiny_config(path: Path, sp: dict | None = None, rollout: dict | None = None, loader: dict | None = None,
                **trainer) -> Path:
    config = json.loads((ROOT / "ds_configs" / "grpo_tiny_cpu.json").read_text())
    config["flexrl"]["trainer"].update(trainer)
    config["flexrl"]["data"]["loader"].update(loader or {})
    config["flexrl"]["sp"].update(sp or {})
    config["flexrl"]["rollout"].update(rollout or {})
    config["flexrl"]["rl"]["old_logprob_pass"] = "always"  # its timing parts are checked here; the skip: test_train_grpo.py
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from flexrl_ds.bench.datasets import make_dataset
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("train")
    make_tiny_model(TinyModelConfig(out_dir=str(root / "model")))
    make_dataset(root / "data", "video-heavy", 12, "medium", seed=0, task="keyword")
    return root


def run_train(assets: Path, out: Path, max_steps: int, resume: bool = False, sp: dict | None = None,
              rollout: dict | None = None, loader: dict | None = None, **trainer) -> int:
    from flexrl_ds.cli.main import main

    config = tiny_config(out.parent / f"{out.name}.json", sp, rollout, loader, **trainer)
    argv = ["train", "--config", str(config), "--model", str(assets / "model"),
            "--data", str(assets / "data" / "train.jsonl"), "--out", str(out), "--max-steps", str(max_steps)]
    return main(argv + (["--resume"] if resume else []))


@pytest.fixture(scope="module")
def run_a(assets, ray_session):
    out = assets / "run_a"
    assert run_train(assets, out, 3, save_every=2, profile_step=1) == 0
    return out


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def rollouts(out: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (out / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()]


def meminfo_kib(field: str) -> int:
    """A /proc/meminfo field in KiB (an independent reading of the node's memory)."""
    for line in open("/proc/meminfo"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def test_outputs_and_metrics(run_a):
    from flexrl_ds.trainer.driver import INFERENCE_PARTS
    from flexrl_ds.trainer.rollout_host import ROLLOUT_PARTS

    metrics = rows(run_a)
    assert [row["step"] for row in metrics] == [0, 1, 2]
    for row in metrics:
        assert all(key in row for key in REQUIRED) and set(PHASES) <= set(row["time_s"])
        assert math.isfinite(row["loss"]) and row["grad_norm"] > 0 and row["num_samples"] == 16
        parts = row["rollout_time_s"]  # colocated engines: every part, each the slowest rank's
        assert set(parts) == set(ROLLOUT_PARTS)
        assert all(0 <= seconds <= row["time_s"]["rollout"] for seconds in parts.values())
        inference = row["inference_time_s"]  # the driver's plan, the two passes, and on the ranks their parts
        assert set(inference) == set(INFERENCE_PARTS) and min(inference.values()) > 0
        assert inference["plan"] + inference["old"] + inference["reference"] <= row["time_s"]["inference"]
        assert inference["batches"] + inference["forward"] <= inference["old"] + inference["reference"]
        for key in ("alloc_retries", "device_mallocs"):  # torch's allocator per phase: nothing on CPU
            assert row[key] == {phase: 0.0 for phase in ("rollout", "inference", "update", "sync")}, key
        assert set(row["gc_pause_s"]) == {"rollout", "inference", "update", "sync"}
        assert all(0 <= seconds <= row["time_s"][phase] for phase, seconds in row["gc_pause_s"].items())
        node_gib = meminfo_kib("MemTotal") / 2**20  # every rank is on this machine
        for phase, used in row["peak_host_used_gb"].items():  # the node's host memory in use, per phase
            assert 0 < used <= node_gib, (phase, used)
            assert row["peak_host_used_share"][phase] == pytest.approx(used / node_gib, rel=1e-3)
        assert row["rollout_pixel_mb"] >= 0
        assert row["rollout_engine_peak_gb"] == 0  # measured on GPUs only
        assert row["num_bad_records"] == 0  # the generated dataset's records are all good
    assert any(row["rollout_pixel_mb"] > 0 for row in metrics)  # the video-heavy data's media reached the hosts
    assert (run_a / "checkpoints" / "step_1" / "trainer_state.json").exists()
    assert (run_a / "checkpoints" / "step_2" / "trainer_state.json").exists()
    assert (run_a / "metrics.png").exists()
    degrees = {pack["degree"] for step in range(3)
               for pack in json.loads((run_a / "plans" / f"step_{step}.json").read_text())["packs"]}
    assert max(degrees) > 1, f"FlexUlysses used only degree 1: {degrees}"
    assert all(row["micro_batches"] == {"inference": 1, "update": 1} for row in metrics)  # no token cap: one pass
    documented = (ROOT / "docs" / "OUTPUTS.md").read_text()  # every key a row has is explained there
    assert not [key for key in metrics[0] if f"`{key}`" not in documented]


def test_the_profiled_step_names_each_ranks_regions(run_a):
    """flexrl.trainer.profile_step 1: each of the 4 ranks wrote its profile of step 1 only, with the
    passes' regions: 2 log-prob forwards (old policy, reference) and one update."""
    assert sorted(p.name for p in (run_a / "profile").iterdir()) == sorted(
        f"step_1_rank_{r}{ext}" for r in range(4) for ext in (".txt", ".json.gz"))
    for rank in range(4):
        text = (run_a / "profile" / f"step_1_rank_{rank}.txt").read_text()
        calls = {line.split()[0]: int(line.split()[1]) for line in text.splitlines() if line.startswith("flexrl/")}
        assert calls["flexrl/logprob_forward"] == 2 and calls["flexrl/build_batches"] == 3
        assert calls["flexrl/forward"] == calls["flexrl/backward"] == calls["flexrl/optimizer_step"] == 1


def test_rewards_and_advantages_recomputed(run_a):
    from flexrl_ds.rl.rewards import REWARDS

    data = {json.loads(line)["id"]: json.loads(line)
            for line in (run_a.parent / "data" / "train.jsonl").read_text().splitlines()}
    for step in range(3):
        samples = rollouts(run_a, step)
        expected = REWARDS["keyword_letters"]([s["response"] for s in samples], [data[s["id"]] for s in samples])
        assert [s["reward"] for s in samples] == pytest.approx(expected)
        groups: dict[str, list[dict]] = {}
        for sample in samples:
            groups.setdefault(sample["sample"].rsplit("k", 1)[0], []).append(sample)
        for group in groups.values():
            rewards = [s["reward"] for s in group]
            mean = sum(rewards) / len(rewards)
            std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1))
            for sample in group:
                reference = 0.0 if max(rewards) == min(rewards) else (sample["reward"] - mean) / (std + 1e-9)
                assert sample["advantage"] == pytest.approx(reference, abs=1e-6)
        assert rows(run_a)[step]["reward_mean"] == pytest.approx(sum(expected) / len(expected))


def test_engine_generates_with_the_current_weights(run_a):
    """After every sync the rollout engine's log-probs of its own samples equal the trainer's."""
    data = {json.loads(line)["id"]: json.loads(line)
            for line in (run_a.parent / "data" / "train.jsonl").read_text().splitlines()}
    for step, row in enumerate(rows(run_a)):
        assert row["rollout_logprob_diff"] < 1e-4, row["rollout_logprob_diff"]
        samples = rollouts(run_a, step)
        kinds = {s["id"]: "+".join(kind for kind in ("image", "video") if data[s["id"]].get(kind + "s")) or "text"
                 for s in samples}
        assert [s["media"] for s in samples] == [kinds[s["id"]] for s in samples]
        assert set(row["rollout_logprob_diff_by_media"]) == set(kinds.values())
        assert max(row["rollout_logprob_diff_by_media"].values()) < 1e-4
        assert max(s["logprob_diff"] for s in samples) < 1e-4


def test_engines_that_keep_their_weights_while_asleep_sample_as_those_that_drop_them(run_a, assets):
    """Run A's colocated engines free their weights at every sleep (flexrl.rollout.hf.sleep_level 2,
    the default), so the trainer syncs before step 0 and after every update; at sleep_level 1 they
    keep them (in host memory on a GPU) and start from the model directory's. Step 0 samples run A's
    responses, and every step's engine log-probs equal the trainer's."""
    out = assets / "run_keeping"
    assert run_train(assets, out, 2, rollout={"hf": {"sleep_level": 1}}) == 0
    assert [s["response_ids"] for s in rollouts(out, 0)] == [s["response_ids"] for s in rollouts(run_a, 0)]
    for row in rows(out):
        assert row["rollout_logprob_diff"] < 1e-4, (row["step"], row["rollout_logprob_diff"])


def test_hf_export_loads_and_was_trained(run_a):
    import transformers

    exported = transformers.AutoModelForImageTextToText.from_pretrained(run_a / "hf" / "step_2")
    initial = transformers.AutoModelForImageTextToText.from_pretrained(run_a.parent / "model")
    moved = [name for name, p in exported.named_parameters()
             if not torch.equal(p, dict(initial.named_parameters())[name])]
    assert moved, "the exported weights equal the initial ones"
    assert (run_a / "hf" / "step_2" / "tokenizer_config.json").exists()


def test_resume_reproduces_the_next_step(run_a, assets):
    for rank in range(4):  # every rank's RNG states, in its own model-states file
        states = torch.load(run_a / "checkpoints" / "step_1" / "policy" / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
                            map_location="cpu", weights_only=False)
        assert sorted(key for key in states if key.startswith("rng_")) == [f"rng_{rank}"]
        assert set(states[f"rng_{rank}"]) == {"torch", "numpy", "python"}
    out = assets / "run_b"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(run_a / "checkpoints" / "step_1", out / "checkpoints" / "step_1")
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(run_a)[:2]))
    assert run_train(assets, out, 3, resume=True, save_every=2) == 0
    a, b = rollouts(run_a, 2), rollouts(out, 2)
    assert [s["sample"] for s in a] == [s["sample"] for s in b]
    assert [s["id"] for s in a] == [s["id"] for s in b]
    assert [s["response_ids"] for s in a] == [s["response_ids"] for s in b]
    row_a, row_b = rows(run_a)[2], rows(out)[2]
    for key in ("reward_mean", "loss", "pg_loss", "kl", "grad_norm", "response_length_mean"):
        assert row_b[key] == pytest.approx(row_a[key], rel=1e-4, abs=1e-6), key
    from safetensors.torch import load_file

    weights_a = load_file(run_a / "hf" / "step_2" / "model.safetensors")
    weights_b = load_file(out / "hf" / "step_2" / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    for name in weights_a:
        torch.testing.assert_close(weights_b[name], weights_a[name], rtol=1e-5, atol=1e-6, msg=name)


def test_resume_of_a_finished_run_stops_before_any_worker(run_a, assets, capsys):
    """--resume with a checkpoint at the last step asked for: said at once, and nothing starts or
    changes (no policy ranks built, metrics.jsonl untouched)."""
    assert (run_a / "checkpoints" / "step_2").is_dir()  # save_last: the checkpoint of the last step
    metrics_before = (run_a / "metrics.jsonl").read_bytes()
    capsys.readouterr()
    assert run_train(assets, run_a, 3, resume=True, save_every=2) == 0
    printed = capsys.readouterr().out
    assert "nothing to do: the checkpoint is after step 3/3 (files: step_2)" in printed
    assert "policy ranks ready" not in printed and "Ray " not in printed
    assert (run_a / "metrics.jsonl").read_bytes() == metrics_before


def test_two_sp_domains_give_the_first_step_of_one_domain(run_a, assets):
    """flexrl.sp.domain_size 2 on 4 ranks: two data-parallel replicas, each with its own plan over
    its share of the samples (ZeRO-3 over all 4 ranks). Step 0 samples the same responses as run A
    (one domain of 4), so its loss and gradient norm must be A's."""
    out = assets / "run_two_domains"
    assert run_train(assets, out, 1, sp={"domain_size": 2, "p_max": 2}) == 0
    plans = [json.loads((out / "plans" / f"step_0_d{d}.json").read_text()) for d in (0, 1)]
    assert [p["world_size"] for p in plans] == [2, 2]
    shares = [{s for pack in p["packs"] for s in pack["sequences"]} for p in plans]
    names = [s["sample"] for s in rollouts(run_a, 0)]
    assert not shares[0] & shares[1] and shares[0] | shares[1] == set(names)
    assert [s["response_ids"] for s in rollouts(out, 0)] == [s["response_ids"] for s in rollouts(run_a, 0)]
    row, row_a = rows(out)[0], rows(run_a)[0]
    for key in ("reward_mean", "loss", "pg_loss", "kl", "grad_norm", "response_length_mean", "num_samples"):
        assert row[key] == pytest.approx(row_a[key], rel=1e-5, abs=1e-7), (key, row[key], row_a[key])
    assert row["rollout_logprob_diff"] < 1e-4


def test_a_step_over_the_token_cap_runs_in_micro_batches_and_gives_the_uncut_step(run_a, assets, capsys):
    """flexrl.sp.max_tokens_per_rank low enough that every prompt still fits one sequence's share
    but the step's samples together overflow the 4 ranks: the log-prob passes and the update run as
    micro-batches (said, counted, their plans saved), and step 0 equals run A's uncut step 0."""
    samples = rollouts(run_a, 0)
    longest = max(len(s["prompt_ids"]) for s in samples) + tiny_config_value("rollout", "max_response_length")
    cap = 2 * math.ceil(longest / tiny_config_value("sp", "p_max"))
    step_tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    assert step_tokens > 4 * cap  # the precondition: one pass cannot hold the step
    out = assets / "run_micro"
    capsys.readouterr()
    assert run_train(assets, out, 1, sp={"max_tokens_per_rank": cap}) == 0
    printed = capsys.readouterr().out
    row, row_a = rows(out)[0], rows(run_a)[0]
    assert row["num_prompts_too_long"] == 0 and row["num_samples"] == row_a["num_samples"]
    assert row["micro_batches"]["inference"] > 1 and row["micro_batches"]["update"] > 1
    assert (f"plan: step 0: old-policy and reference log-probs: {len(samples)} samples do not plan in one pass "
            f"under flexrl.sp.max_tokens_per_rank {cap} x 4 ranks") in printed
    assert f"run as {row['micro_batches']['inference']} micro-batches" in printed
    lengths = {s["sample"]: len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples}
    planned = []
    for index in range(row["micro_batches"]["inference"]):  # each plan under the cap, every sample once
        held = [0.0] * 4
        for pack in json.loads((out / "plans" / f"step_0_micro{index}.json").read_text())["packs"]:
            planned += pack["sequences"]
            for rank in pack["ranks"]:
                held[rank] += sum(lengths[s] for s in pack["sequences"]) / pack["degree"]
        assert max(held) <= cap
    assert sorted(planned) == sorted(lengths)
    assert [s["response_ids"] for s in rollouts(out, 0)] == [s["response_ids"] for s in samples]
    for key in ("reward_mean", "loss", "pg_loss", "kl", "entropy", "grad_norm"):
        assert row[key] == pytest.approx(row_a[key], rel=1e-5, abs=1e-7), (key, row[key], row_a[key])
    assert row["rollout_logprob_diff"] < 1e-4


def test_a_looser_cap_for_the_log_prob_passes_cuts_only_the_update(run_a, assets, capsys):
    """flexrl.sp.logprob_max_tokens_per_rank above the step's tokens: the log-prob passes run whole,
    the update in micro-batches (planned on its own), and step 0 is still run A's."""
    samples = rollouts(run_a, 0)
    longest = max(len(s["prompt_ids"]) for s in samples) + tiny_config_value("rollout", "max_response_length")
    cap = 2 * math.ceil(longest / tiny_config_value("sp", "p_max"))
    step_tokens = sum(len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples)
    out = assets / "run_loose"
    capsys.readouterr()
    assert run_train(assets, out, 1, sp={"max_tokens_per_rank": cap, "logprob_max_tokens_per_rank": step_tokens}) == 0
    printed = capsys.readouterr().out
    row, row_a = rows(out)[0], rows(run_a)[0]
    assert row["micro_batches"]["inference"] == 1 and row["micro_batches"]["update"] > 1
    assert "log-probs:" not in printed
    assert (f"plan: step 0: update mini-batch 0 (gradients accumulated in float32 into one optimizer step): "
            f"{len(samples)}") in printed
    assert (out / "plans" / "step_0.json").exists() and (out / "plans" / "step_0_mb0_micro0.json").exists()
    for key in ("reward_mean", "loss", "pg_loss", "kl", "entropy", "grad_norm"):
        assert row[key] == pytest.approx(row_a[key], rel=1e-5, abs=1e-7), (key, row[key], row_a[key])


def test_the_reference_with_its_parameters_in_host_memory_gives_the_same_steps(run_a, assets, capsys):
    """flexrl.trainer.reference_offload_param: the reference engine's parameters live in host memory
    (DeepSpeed's offload_param, as every rank reports); its log-probs, hence the KL term from step 1
    on, are run A's."""
    out = assets / "run_ref_offload"
    capsys.readouterr()
    assert run_train(assets, out, 2, reference_offload_param=True) == 0
    assert ("flexrl train: the reference model's parameters wait in host memory (DeepSpeed offload_param) on "
            "4 of 4 policy ranks") in capsys.readouterr().out
    assert rows(run_a)[1]["kl"] > 0  # step 1's policy has moved: the reference's log-probs count
    for row, row_a in zip(rows(out), rows(run_a)[:2], strict=True):
        for key in ("reward_mean", "loss", "pg_loss", "kl", "entropy", "grad_norm"):
            assert row[key] == pytest.approx(row_a[key], rel=1e-5, abs=1e-7), (row["step"], key, row[key], row_a[key])


def test_a_domain_short_of_samples_for_the_micro_batches_idles_through_the_rest(assets, ray_session, capsys):
    """3 prompts on 2 SP domains: one domain gets one prompt's samples, the other two prompts'. Under
    a cap that holds one sample per pass, the larger share needs more micro-batches than the smaller
    has samples: the smaller domain idles through the rest (said), and the step equals the same
    step uncut on one domain of 4 ranks."""
    reference = assets / "run_three_prompts"
    assert run_train(assets, reference, 1, loader={"global_batch": 3}) == 0
    samples = rollouts(reference, 0)
    lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
    longest_possible = max(len(s["prompt_ids"]) for s in samples) + tiny_config_value("rollout", "max_response_length")
    cap = math.ceil(longest_possible / 2)  # every sample fits at degree 2; no two fit in one pass of 2 ranks
    assert cap < min(lengths), (cap, lengths)
    out = assets / "run_idle_domain"
    capsys.readouterr()
    assert run_train(assets, out, 1, loader={"global_batch": 3}, sp={"domain_size": 2, "p_max": 2,
                                                                     "max_tokens_per_rank": cap}) == 0
    printed = capsys.readouterr().out
    row, row_ref = rows(out)[0], rows(reference)[0]
    assert row["num_samples"] == row_ref["num_samples"] == 12 and row["num_prompts_too_long"] == 0
    assert row["micro_batches"]["inference"] == 8  # the two-prompt domain's samples one at a time
    assert any(f"SP domain {domain} idles in micro-batch(es) 4, 5, 6, 7 (numbered from 0, as the plan files; "
               "it has 4 samples for 8 micro-batches)" in printed for domain in (0, 1))
    assert [s["response_ids"] for s in rollouts(out, 0)] == [s["response_ids"] for s in samples]
    for key in ("reward_mean", "loss", "pg_loss", "kl", "entropy", "grad_norm"):
        assert row[key] == pytest.approx(row_ref[key], rel=1e-5, abs=1e-7), (key, row[key], row_ref[key])


def tiny_config_value(section: str, key: str):
    return json.loads((ROOT / "ds_configs" / "grpo_tiny_cpu.json").read_text())["flexrl"][section][key]
