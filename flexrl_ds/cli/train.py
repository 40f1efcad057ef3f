"""`flexrl train`: GRPO training of a vision-language model (flexrl_ds/trainer/launch.py)."""

from __future__ import annotations

from flexrl_ds.config.flexrl_config import effective_run_config, load_run_config


def register(commands, bench) -> None:
    train = commands.add_parser(
        "train",
        help="GRPO training: Ray driver, DeepSpeed ZeRO-3 policy/reference ranks with FlexUlysses, rollouts, rewards",
        description="Runs GRPO steps configured by a DeepSpeed JSON with a 'flexrl' section. Without RAY_ADDRESS "
                    "a new local Ray is started; with it (a GCS address, host:port) that cluster is joined, as "
                    "under `ray job submit`. With --spmd "
                    "(scripts/train_deepspeed.sh) the launcher's processes are the policy ranks and rank 0 drives. "
                    "Outputs under --out: metrics.jsonl, metrics.png, tensorboard/, plans/, rollouts/ (with "
                    "flexrl.trainer.save_rollouts), checkpoints/, hf/. An --out holding another run's steps is "
                    "refused unless --resume continues it.",
    )
    train.add_argument("--config", required=True, help="DeepSpeed JSON with a 'flexrl' section (ds_configs/)")
    train.add_argument("--model", required=True, help="HF model directory the policy starts from")
    train.add_argument("--data", required=True, help="dataset (.jsonl / .parquet; fields: docs/DATA_FORMAT.md)")
    train.add_argument("--out", required=True, help="output directory")
    train.add_argument("--max-steps", type=int, default=None,
                       help="GRPO steps in all (default: flexrl.trainer.max_steps)")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint under --out")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY.PATH=VALUE",
                       help="override one config value, e.g. --set flexrl.rl.init_kl_coef=0.01 --set "
                            "optimizer.params.lr=1e-6 (VALUE read as JSON, else a string; validated like the "
                            "file; the run's saved config records the result); repeatable")
    train.add_argument("--spmd", action="store_true",
                       help="run as one rank of a launcher-started job (deepspeed --hostfile / torchrun)")
    train.set_defaults(func=_train)
    _add_estimate_memory(commands)


def _add_estimate_memory(commands) -> None:
    estimate = commands.add_parser(
        "estimate-memory",
        help="a run's device memory per phase (rollout, log-probs, update, sync), before it starts",
        description="What `flexrl train` checks before any worker starts (flexrl.trainer.memory_check): per phase, "
                    "the ZeRO-3 states, the reference, the colocated engine, ZeRO-3's gathered parameters, the "
                    "activations at the planned tokens per rank and the log-prob chunk, on one policy rank's device "
                    "(trainer/memory_estimate.py). Exit code 0 when it fits, 1 when not.")
    estimate.add_argument("--config", required=True, help="DeepSpeed JSON with a 'flexrl' section")
    estimate.add_argument("--model", required=True, help="HF model directory (only its config.json is read)")
    estimate.add_argument("--device-memory-gb", type=float, default=None,
                          help="device memory in GiB (default: flexrl.trainer.device_memory_gb, "
                               "else this machine's GPU)")
    estimate.add_argument("--ranks", type=int, default=None,
                          help="policy ranks (default: flexrl.trainer.num_policy_ranks)")
    estimate.add_argument("--prompt-tokens", type=int, default=0,
                          help="tokens of a prompt, vision tokens included (default 0: the responses alone)")
    estimate.set_defaults(func=_estimate_memory)


def _estimate_memory(args) -> int:
    from flexrl_ds.trainer.memory_check import estimate_run  # lazy: imports torch and transformers

    run = load_run_config(args.config)
    text, fits = estimate_run(run, args.model, args.ranks, args.device_memory_gb, args.prompt_tokens)
    print(text)
    return 0 if fits else 1


def _train(args) -> int:
    # lazy: imports torch and Ray (`flexrl --help` stays fast)
    from flexrl_ds.trainer.launch import TrainArgs, train_spmd, train_with_ray

    run, raw = effective_run_config(args.config, args.overrides)
    train_args = TrainArgs(args.config, args.model, args.data, args.out, args.max_steps, args.resume, args.spmd,
                           tuple(args.overrides))
    return (train_spmd if args.spmd else train_with_ray)(run, train_args, raw)
