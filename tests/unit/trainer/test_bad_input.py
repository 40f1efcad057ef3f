"""Bad input is refused by `launch.prepare` (and `flexrl train`) before Ray or any worker starts.

Each case edits one thing of the shipped tiny config, model or dataset, and expects a ValueError
whose message names that thing; the unedited inputs pass, so each failure is the edit's.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import ray

from flexrl_ds.config.flexrl_config import parse_run_config
from flexrl_ds.trainer.launch import TrainArgs, prepare


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """Any attempt to start or join Ray fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started during input validation")

    was_initialized = ray.is_initialized()  # another test's session cluster may be up already
    monkeypatch.setattr(ray, "init", refuse)
    yield
    assert ray.is_initialized() == was_initialized


def _prepare(raw: dict, tmp_path: Path, model: str, data: str):
    config_path = tmp_path / "run.json"
    config_path.write_text(json.dumps(raw))
    run = parse_run_config(raw, source=str(config_path))
    return prepare(run, TrainArgs(str(config_path), model, data, str(tmp_path / "out")))


def _refused(raw: dict, tmp_path: Path, model: str, data: str, *fragments: str) -> str:
    with pytest.raises(ValueError) as caught:
        _prepare(raw, tmp_path, model, data)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    return message


def test_valid_inputs_pass(raw_config, tmp_path, trainer_assets):
    prepared = _prepare(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"])
    flexrl = raw_config["flexrl"]
    assert prepared.num_ranks == flexrl["trainer"]["num_policy_ranks"]
    assert prepared.max_steps == flexrl["trainer"]["max_steps"]
    lines = [line for line in Path(trainer_assets["data"]).read_text().splitlines() if line.strip()]
    assert len(prepared.records) == len(lines)


def test_samples_not_divisible_over_ranks(raw_config, tmp_path, trainer_assets):
    loader = raw_config["flexrl"]["data"]["loader"]
    ranks = raw_config["flexrl"]["trainer"]["num_policy_ranks"]
    loader["global_batch"], loader["num_samples_per_prompt"] = 3, 3
    assert (3 * 3) % ranks != 0
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"],
             "num_policy_ranks", str(3 * 3), str(ranks))


def test_p_max_over_the_domain(raw_config, tmp_path, trainer_assets):
    ranks = raw_config["flexrl"]["trainer"]["num_policy_ranks"]
    raw_config["flexrl"]["sp"]["p_max"] = 2 * ranks
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"],
             "flexrl.sp.p_max", str(2 * ranks), "num_policy_ranks", f"set flexrl.sp.p_max to {ranks} or less, "
             "or run more ranks")


def test_a_default_p_max_over_the_domain_says_it_is_the_default(raw_config, tmp_path, trainer_assets):
    """A config without `flexrl.sp.p_max` on fewer ranks than its default: the user never wrote the
    value refused, so the message says where it came from."""
    from flexrl_ds.planning.config import SPConfig

    raw_config["flexrl"]["sp"].pop("p_max", None)
    raw_config["flexrl"]["trainer"]["num_policy_ranks"] = ranks = SPConfig().p_max // 2
    raw_config["flexrl"]["data"]["loader"]["global_batch"] = ranks
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"],
             f"flexrl.sp.p_max {SPConfig().p_max} exceeds the SP domain of {ranks} ranks",
             f"set flexrl.sp.p_max to {ranks} or less, or run more ranks ({SPConfig().p_max} is also its default, "
             "where flexrl.sp sets none)")


def test_the_p_max_advice_is_a_power_of_two_and_names_the_domain_size(raw_config, tmp_path, trainer_assets):
    flexrl = raw_config["flexrl"]
    flexrl["trainer"]["num_policy_ranks"], flexrl["sp"]["p_max"] = 6, 8
    flexrl["data"]["loader"]["global_batch"], flexrl["data"]["loader"]["num_samples_per_prompt"] = 3, 4
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"],
             "exceeds the SP domain of 6 ranks", "set flexrl.sp.p_max to 4 or less, or run more ranks")
    flexrl["trainer"]["num_policy_ranks"], flexrl["sp"]["domain_size"], flexrl["sp"]["p_max"] = 4, 2, 4
    flexrl["data"]["loader"]["global_batch"] = 4
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"],
             "exceeds the SP domain of 2 ranks", "set flexrl.sp.p_max to 2 or less, or raise flexrl.sp.domain_size")


def test_several_sp_domains_pass_and_bad_domain_sizes_are_refused(raw_config, tmp_path, trainer_assets):
    ranks = raw_config["flexrl"]["trainer"]["num_policy_ranks"]
    assert ranks % 2 == 0
    sp = raw_config["flexrl"]["sp"]
    sp["domain_size"], sp["p_max"] = ranks // 2, ranks // 2
    _prepare(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"])  # two domains
    sp["p_max"] = ranks
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"],
             "flexrl.sp.p_max", str(ranks), f"SP domain of {ranks // 2} ranks", "flexrl.sp.domain_size")
    sp["domain_size"], sp["p_max"] = 3, 1
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"],
             "flexrl.sp.domain_size 3", str(ranks), "does not divide")


def test_mini_batches_not_dividing_the_prompts(raw_config, tmp_path, trainer_assets):
    batch = raw_config["flexrl"]["data"]["loader"]["global_batch"]
    num = next(k for k in range(2, batch + 2) if batch % k)
    raw_config["flexrl"]["rl"]["mini_batches_per_step"] = num
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"],
             "mini_batches_per_step", str(num), str(batch))


def test_greedy_rollouts_are_refused_for_training(raw_config, tmp_path, trainer_assets):
    """Temperature 0 would give every sample of a prompt the same response: no advantage, no learning."""
    raw_config["flexrl"]["rollout"]["temperature"] = 0.0
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"],
             "flexrl.rollout.temperature", "greedy", "> 0")


@pytest.mark.parametrize("estimator", ["group_norm", "dr_grpo", "rloo"])
def test_groups_of_one_sample_are_refused_for_every_estimator(raw_config, tmp_path, trainer_assets, estimator):
    """A prompt's only sample has advantage 0 under every estimator: only the KL term would train."""
    raw_config["flexrl"]["rl"]["advantage_estimator"] = estimator
    loader = raw_config["flexrl"]["data"]["loader"]
    loader["num_samples_per_prompt"], loader["global_batch"] = 1, 4
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"],
             f"advantage_estimator {estimator!r} needs", "num_samples_per_prompt >= 2, got 1")


@pytest.mark.parametrize("oversize", ["drop", "truncate"])
def test_oversize_other_than_error_is_refused_for_training(raw_config, tmp_path, trainer_assets, oversize):
    raw_config["flexrl"]["sp"]["oversize"] = oversize
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"],
             f"flexrl.sp.oversize: {oversize!r} is for the planning tools", "'error'")


def test_a_global_batch_over_the_dataset_is_refused(raw_config, tmp_path, trainer_assets):
    rows = sum(1 for line in Path(trainer_assets["data"]).read_text().splitlines() if line.strip())
    raw_config["flexrl"]["data"]["loader"]["global_batch"] = rows * 2
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"],
             f"flexrl.data.loader.global_batch: {rows * 2} prompts a step", f"the {rows} rows of")


def test_an_out_dir_holding_a_run_needs_resume(raw_config, tmp_path, trainer_assets):
    """Without --resume a run would rewrite metrics.jsonl over another run's steps and leave its
    checkpoints for a later --resume; an empty or new folder is fine."""
    model, data = trainer_assets["model"], trainer_assets["data"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")  # a run that stopped before its first step: nothing to keep
    _prepare(raw_config, tmp_path, model, data)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')  # steps, but no checkpoint to continue from
    _refused(raw_config, tmp_path, model, data, f"--out {out} already holds a run (metrics.jsonl)",
             "no complete checkpoint, so --resume would start over at step 0")
    (out / "checkpoints" / "step_1").mkdir(parents=True)
    state = out / "checkpoints" / "step_1" / "trainer_state.json"
    state.write_text('{"step": 1}')
    _refused(raw_config, tmp_path, model, data,
             f"--out {out} already holds a run (metrics.jsonl, checkpoints/step_1): pass --resume to continue it")
    config_path = tmp_path / "run.json"
    run = parse_run_config(raw_config, source=str(config_path))
    prepared = prepare(run, TrainArgs(str(config_path), model, data, str(out), resume=True))  # continuing it is fine
    assert (prepared.checkpoint, prepared.start_step) == (out / "checkpoints" / "step_1", 2)
    state.write_text("{}")  # cut short: said with the file, not as a KeyError
    with pytest.raises(ValueError, match=re.escape(f"{state}: no integer 'step' in it")):
        prepare(run, TrainArgs(str(config_path), model, data, str(out), resume=True))


def test_engine_settings_a_colocated_run_ignores_are_named(raw_config, capsys, tmp_path, trainer_assets):
    raw_config["flexrl"]["trainer"]["colocate"] = True
    raw_config["flexrl"]["rollout"]["num_engines"] = 3
    _prepare(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"])
    out = capsys.readouterr().out
    assert "flexrl.rollout.num_engines = 3 is ignored: each policy rank holds one engine" in out
    assert "num_gpus_per_engine" not in out  # left at its default: nothing to say
    raw_config["flexrl"]["trainer"]["colocate"] = False  # separate engines use it
    _prepare(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"])
    assert "is ignored" not in capsys.readouterr().out


def test_settings_a_launcher_started_run_ignores_are_named():
    from flexrl_ds.config.flexrl_config import FlexRLConfig
    from flexrl_ds.trainer.validation import ignored_settings

    flexrl = FlexRLConfig()
    flexrl.trainer.colocate, flexrl.trainer.num_policy_ranks, flexrl.rollout.num_engines = False, 2, 3
    lines = ignored_settings(flexrl, spmd_world=4)
    assert lines[0].startswith("flexrl.trainer.colocate = false is ignored under --spmd")
    assert "num_policy_ranks = 2 is ignored under --spmd: the launcher started 4 ranks" in lines[1]
    assert "flexrl.rollout.num_engines = 3 is ignored" in lines[2] and len(lines) == 3
    flexrl.trainer.max_restarts = 2  # only the Ray driver rebuilds lost workers
    assert "flexrl.trainer.max_restarts = 2 is ignored under --spmd" in "\n".join(ignored_settings(flexrl, 4))
    assert not any("max_restarts" in line for line in ignored_settings(flexrl, spmd_world=None))


def test_the_gradient_accumulation_dtype_is_deepspeeds():
    """ZeRO-3 adds micro-batch gradients in `data_types.grad_accum_dtype` where set, else in the
    model's dtype (DeepSpeed's engine `get_data_types`)."""
    from flexrl_ds.trainer.validation import gradient_accumulation_dtype

    assert gradient_accumulation_dtype({}) == "float32"
    assert gradient_accumulation_dtype({"bf16": {"enabled": True}}) == "bfloat16"
    assert gradient_accumulation_dtype({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}) == \
        "float32"
    assert gradient_accumulation_dtype({"data_types": {"grad_accum_dtype": "bf16"}}) == "bfloat16"


def test_a_reference_offload_without_a_reference_is_named():
    from flexrl_ds.config.flexrl_config import FlexRLConfig
    from flexrl_ds.trainer.validation import ignored_settings

    flexrl = FlexRLConfig()
    flexrl.trainer.reference_offload_param, flexrl.trainer.colocate = True, False
    assert ignored_settings(flexrl) == []  # a reference exists (init_kl_coef > 0): it is used
    flexrl.rl.init_kl_coef = 0.0
    assert ignored_settings(flexrl) == ["flexrl.trainer.reference_offload_param = true is ignored: "
                                        "flexrl.rl.init_kl_coef is 0, so the run builds no reference model"]


def test_launcher_ranks_are_named_before_the_checks_they_fail(raw_config, capsys, tmp_path, trainer_assets):
    """Under --spmd the launcher's ranks replace num_policy_ranks: said before a check that fails
    because of it (a hostfile with 2 slots against p_max 4), so the refusal is understood."""
    raw_config["flexrl"]["trainer"]["num_policy_ranks"] = 4
    raw_config["flexrl"]["sp"]["p_max"] = 4
    config_path = tmp_path / "run.json"
    config_path.write_text(json.dumps(raw_config))
    run = parse_run_config(raw_config, source=str(config_path))
    args = TrainArgs(str(config_path), trainer_assets["model"], trainer_assets["data"], str(tmp_path / "out"), spmd=True)
    with pytest.raises(ValueError, match="p_max"):
        prepare(run, args, num_ranks=2)
    assert "num_policy_ranks = 4 is ignored under --spmd: the launcher started 2 ranks" in capsys.readouterr().out


def test_a_token_cap_leaving_no_room_for_a_prompt_is_refused(raw_config, tmp_path, trainer_assets):
    """Every prompt would be set aside at every step: said before anything starts."""
    sp, rollout = raw_config["flexrl"]["sp"], raw_config["flexrl"]["rollout"]
    sp["max_tokens_per_rank"] = rollout["max_response_length"] // sp["p_max"]  # cap x p_max <= the response
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"],
             f"flexrl.rollout.max_response_length {rollout['max_response_length']}: a sequence may hold",
             "so no prompt fits next to the longest response")
    sp["max_tokens_per_rank"] = rollout["max_response_length"]  # room to spare at any degree
    _prepare(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"])


def test_spmd_rank_0_tells_the_ranks_a_finished_run_has_nothing_to_do(raw_config, tmp_path, trainer_assets, capsys):
    """Under a launcher, a --resume of a finished run ends every rank before Ray or the loader starts."""
    from flexrl_ds.trainer.checkpoint import write_trainer_state
    from flexrl_ds.trainer.launch import SPMD_NOTHING_TO_DO, _spmd_driver_start

    out = tmp_path / "out"
    last = raw_config["flexrl"]["trainer"]["max_steps"] - 1
    (out / "checkpoints" / f"step_{last}").mkdir(parents=True)
    write_trainer_state(out / "checkpoints" / f"step_{last}", last, last + 1, raw_config)
    config_path = tmp_path / "run.json"
    config_path.write_text(json.dumps(raw_config))
    run = parse_run_config(raw_config, source=str(config_path))
    args = TrainArgs(str(config_path), trainer_assets["model"], trainer_assets["data"], str(out), resume=True, spmd=True)
    told, kept = _spmd_driver_start(run, args, raw_config["flexrl"]["trainer"]["num_policy_ranks"])
    assert (told, kept) == (SPMD_NOTHING_TO_DO, None)
    assert "nothing to do" in capsys.readouterr().out


@pytest.mark.parametrize("address", ["http://127.0.0.1:8265", "https://head:8265"])
def test_a_job_server_url_as_ray_address_is_refused(raw_config, tmp_path, trainer_assets, monkeypatch, address):
    monkeypatch.setenv("RAY_ADDRESS", address)
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"],
             f"RAY_ADDRESS={address}", "job server", "GCS address")


def test_a_ray_address_where_nothing_listens_is_refused_at_once(raw_config, tmp_path, trainer_assets, monkeypatch):
    """A host:port RAY_ADDRESS with no cluster behind it: one line within seconds, not Ray's minutes
    of retries (the port is one the OS just gave out and took back, so nothing listens on it)."""
    import socket
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    start = time.perf_counter()
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"],
             f"RAY_ADDRESS=127.0.0.1:{port}: no Ray cluster reachable there", "ray start --head")
    assert time.perf_counter() - start < 30


def test_a_ray_address_whose_host_does_not_resolve_says_so(monkeypatch):
    from flexrl_ds.runtime.ray_session import ray_address

    monkeypatch.setenv("RAY_ADDRESS", "no-such-host.invalid:6379")  # .invalid never resolves (RFC 2606)
    with pytest.raises(ValueError, match=r"reachable there \(cannot resolve the host 'no-such-host.invalid'\)"):
        ray_address()


def test_a_ray_address_that_accepts_connections_passes_the_check(monkeypatch):
    import socket

    from flexrl_ds.runtime.ray_session import ray_address

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        monkeypatch.setenv("RAY_ADDRESS", address)
        assert ray_address() == address
    for left_to_ray in ("auto", "ray://head:10001", "::1:6379"):
        monkeypatch.setenv("RAY_ADDRESS", left_to_ray)
        assert ray_address() == left_to_ray


def test_a_text_only_model_is_refused_as_such(raw_config, tmp_path, trainer_assets):
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    text_only = make_tiny_model(TinyModelConfig(out_dir=str(tmp_path / "qwen2"), arch="qwen2"))
    _refused(raw_config, tmp_path, str(text_only), trainer_assets["data"],
             f"--model {text_only}: a text-only model (model_type 'qwen2', no vision_config)", "Qwen2.5-VL")


def test_missing_relative_paths_name_where_they_were_looked_for(raw_config, tmp_path, trainer_assets, monkeypatch):
    """Under `ray job submit` relative paths resolve in the job's folder: the error says which."""
    monkeypatch.chdir(tmp_path)
    _refused(raw_config, tmp_path, "no_model_here", trainer_assets["data"],
             f"(looked for {tmp_path / 'no_model_here'})")
    _refused(raw_config, tmp_path, trainer_assets["model"], "absent.jsonl", f"(looked for {tmp_path / 'absent.jsonl'})")
    from flexrl_ds.config.flexrl_config import load_run_config

    with pytest.raises(ValueError, match=re.escape(f"(looked for {tmp_path / 'absent.json'})")):
        load_run_config("absent.json")


def test_pixel_settings_the_models_processor_replaces_are_named(raw_config, capsys, tmp_path, trainer_assets):
    from flexrl_ds.media.processor_files import processor_settings

    model = trainer_assets["model"]
    own = processor_settings(model)["image_max_pixels"]
    raw_config["flexrl"]["data"]["image_max_pixels"] = own // 4
    prepared = _prepare(raw_config, tmp_path, model, trainer_assets["data"])
    assert prepared.data_config.image_max_pixels == own  # the model's processor decides
    assert f"flexrl.data.image_max_pixels = {own // 4} is replaced by the model's processor setting {own}" in \
        capsys.readouterr().out
    raw_config["flexrl"]["data"]["image_max_pixels"] = own  # the same value: nothing to say
    _prepare(raw_config, tmp_path, model, trainer_assets["data"])
    assert "is replaced" not in capsys.readouterr().out


def test_unknown_reward_name(raw_config, tmp_path, trainer_assets):
    raw_config["flexrl"]["rl"]["reward_fn"] = "no_such_reward"
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"], "no_such_reward", "reward_fn")


def test_missing_reward_file(raw_config, tmp_path, trainer_assets):
    raw_config["flexrl"]["rl"]["reward_fn"] = "missing_rewards.py:score"
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"],
             "missing_rewards.py", "does not exist")


def test_reward_file_without_the_function(raw_config, tmp_path, trainer_assets):
    (tmp_path / "my_rewards.py").write_text("def other(responses, records):\n    return [0.0] * len(responses)\n")
    raw_config["flexrl"]["rl"]["reward_fn"] = "my_rewards.py:score"
    message = _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"], "'score'")
    assert "other" in message  # the callables that are there


def test_reward_file_is_found_next_to_the_config(raw_config, tmp_path, trainer_assets):
    (tmp_path / "my_rewards.py").write_text("def score(responses, records):\n    return [1.0] * len(responses)\n")
    raw_config["flexrl"]["rl"]["reward_fn"] = "my_rewards.py:score"
    prepared = _prepare(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"])
    assert prepared.reward_fn(["a", "b"], [{}, {}]) == [1.0, 1.0]


def test_missing_model_directory(raw_config, tmp_path, trainer_assets):
    missing = str(tmp_path / "no_model_here")
    _refused(raw_config, tmp_path, missing, trainer_assets["data"], missing, "no such directory")


def test_model_directory_without_config_json(raw_config, tmp_path, trainer_assets):
    folder = tmp_path / "not_a_model"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"\0")
    _refused(raw_config, tmp_path, str(folder), trainer_assets["data"], str(folder), "config.json")


def test_empty_dataset(raw_config, tmp_path, trainer_assets):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    _refused(raw_config, tmp_path, trainer_assets["model"], str(empty), str(empty), "no usable records")


def test_dataset_without_a_usable_record(raw_config, tmp_path, trainer_assets):
    bad = tmp_path / "bad.jsonl"
    rows = [{"id": "marker-mismatch", "prompt": "<image>\nwhat?", "images": []},
            {"id": "no-prompt"}]
    bad.write_text("".join(json.dumps(row) + "\n" for row in rows))
    message = _refused(raw_config, tmp_path, trainer_assets["model"], str(bad), str(bad), "no usable records")
    assert "marker-mismatch" in message and "no-prompt" in message  # the bad records are named


def test_missing_dataset_file(raw_config, tmp_path, trainer_assets):
    missing = tmp_path / "absent.jsonl"
    _refused(raw_config, tmp_path, trainer_assets["model"], str(missing), str(missing))


@pytest.mark.parametrize("key, value", [
    ("gradient_accumulation_steps", 2),
    ("sequence_parallel_size", 2),
    ("zero_optimization", {"stage": 2}),
    ("train_batch_size", 7),
    ("optimizer", None),
])
def test_deepspeed_setting_the_trainer_owns(raw_config, tmp_path, trainer_assets, key, value):
    if value is None:
        del raw_config[key]
    else:
        raw_config[key] = value
    name = "zero_optimization.stage" if key == "zero_optimization" else key
    _refused(raw_config, tmp_path, trainer_assets["model"], trainer_assets["data"], name)


@pytest.mark.parametrize("section, key, value", [
    ("trainer", "num_policy_rank", 2),          # misspelt key
    ("rl", "mini_batches_per_stepp", 1),
    ("trainer", "num_policy_ranks", "two"),     # wrong type
    ("trainer", "num_policy_ranks", 0),         # out of range
])
def test_invalid_config_key(raw_config, section, key, value):
    raw_config["flexrl"][section][key] = value
    with pytest.raises(ValueError) as caught:
        parse_run_config(raw_config, source="run.json")
    message = str(caught.value)
    assert f"flexrl.{section}.{key}" in message or (f"flexrl.{section}:" in message and repr(key) in message), message


def test_tensor_parallel_engines_are_separate_with_a_gpu_per_shard(raw_config, tmp_path, trainer_assets):
    from flexrl_ds.trainer.validation import check_engine_placement

    rollout, trainer = raw_config["flexrl"]["rollout"], raw_config["flexrl"]["trainer"]
    rollout.update(backend="vllm", vllm={"tensor_parallel_size": 2})
    model, data = trainer_assets["model"], trainer_assets["data"]
    _refused(raw_config, tmp_path, model, data, "tensor_parallel_size: 2 needs separate engines (flexrl.trainer.colocate")
    trainer["colocate"] = False
    rollout["num_gpus_per_engine"] = 1
    _refused(raw_config, tmp_path, model, data, "flexrl.rollout.num_gpus_per_engine: ", " must equal ", "(2); got 1")
    rollout["num_gpus_per_engine"] = 2
    check_engine_placement(parse_run_config(raw_config).flexrl)  # accepted (on CPU, prepare then refuses vllm)
    rollout["backend"] = "hf"  # the hf backend ignores the vllm section
    trainer["colocate"] = True
    check_engine_placement(parse_run_config(raw_config).flexrl)


def test_cli_reports_the_cause_and_exits_2(raw_config, tmp_path, trainer_assets, capsys, monkeypatch):
    from flexrl_ds.cli.main import main

    monkeypatch.delenv("FLEXRL_DEBUG", raising=False)
    config_path = tmp_path / "run.json"
    config_path.write_text(json.dumps(raw_config))
    missing = str(tmp_path / "no_model_here")
    code = main(["train", "--config", str(config_path), "--model", missing, "--data", trainer_assets["data"],
                 "--out", str(tmp_path / "out"), "--max-steps", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert re.search(r"^flexrl train: error: .*" + re.escape(missing), err, re.MULTILINE), err


def test_vllm_media_limits_come_from_the_data_or_name_the_record():
    """vllm engines take at most max_{images,videos}_per_prompt per prompt. Unset, each limit is the most
    any record has (at least 1); set, a record over it is refused before any worker starts, by name;
    the hf backend has no such limit."""
    from flexrl_ds.media.types import BadRecord, MediaItem, Record
    from flexrl_ds.rollout.config import RolloutConfig, VLLMOptions
    from flexrl_ds.trainer.validation import resolve_media_limits

    records = [Record("fine", "<image><video>q", (MediaItem("image", "a.png"), MediaItem("video", "v.mp4"))),
               Record("many", "<image><image><image>q", tuple(MediaItem("image", f"{i}.png") for i in range(3)))]
    hf = RolloutConfig(backend="hf")
    assert resolve_media_limits(hf, records) is hf
    bad = BadRecord("dup", "duplicate id", index=3)  # kept among the usable rows for the loader's bad-record policy
    derived = resolve_media_limits(RolloutConfig(backend="vllm"), records + [bad]).vllm
    assert (derived.max_images_per_prompt, derived.max_videos_per_prompt) == (3, 1)
    text_only = resolve_media_limits(RolloutConfig(backend="vllm"), [Record("t", "q", ())]).vllm
    assert (text_only.max_images_per_prompt, text_only.max_videos_per_prompt) == (1, 1)
    kept = resolve_media_limits(RolloutConfig(backend="vllm", vllm=VLLMOptions(max_images_per_prompt=5)), records)
    assert kept.vllm.max_images_per_prompt == 5 and kept.engine_options(colocated=False)["max_images_per_prompt"] == 5
    with pytest.raises(ValueError, match="record 'many': 3 images, more than flexrl.rollout.vllm.max_images_per_prompt = 2"):
        resolve_media_limits(RolloutConfig(backend="vllm", vllm=VLLMOptions(max_images_per_prompt=2)), records)
