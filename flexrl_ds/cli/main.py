"""`flexrl <command>`: one entry point for every tool of the project.

Each subsystem owns a small module here with a `register(commands, bench)` function that adds its
sub-commands: `commands` is the top-level argparse sub-parser set, `bench` the one under
`flexrl bench`. A command's handler is stored as `func` and receives the parsed arguments; it returns
an exit code. A command module imports at its top only what the registration needs (no torch, numpy
or Ray); each handler imports its implementation module (bench/..., tools/..., trainer/launch.py) in
one place, marked `# lazy:`, so that `flexrl --help` stays fast (tests/unit/test_architecture.py).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from flexrl_ds.common import logs
from flexrl_ds.parallel import network

# Modules that register commands, in the order they appear in `flexrl --help`.
COMMAND_MODULES = (
    "flexrl_ds.cli.planning",  # make-workload, plan, simulate, bench planner
    "flexrl_ds.cli.sp_exec",  # bench sp
    "flexrl_ds.cli.models",  # make-tiny-model, logprobs
    "flexrl_ds.cli.data",  # make-dataset, inspect-data
    "flexrl_ds.cli.loader",  # bench loader
    "flexrl_ds.cli.train",  # train
    "flexrl_ds.cli.rollout",  # bench rollout
    "flexrl_ds.cli.faults",  # bench faults
    "flexrl_ds.cli.peers",  # bench trl-peer
)


class UserError(Exception):
    """A problem with the user's input: printed as one line, exit code 2, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexrl",
        description="flexrl_ds: load-balanced GRPO training of vision-language models.",
    )
    # `deepspeed --module flexrl_ds` passes --local_rank=N before the command unless given
    # --no_local_rank; a rank's place comes from the LOCAL_RANK variable it also sets, so the flag is
    # accepted and unused.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--log-level", type=str.upper, choices=logs.LEVELS, default=None,
                        help=f"console log level (default: ${logs.ENV_VAR}, else {logs.DEFAULT_LEVEL}); WARNING "
                             "keeps warnings and errors only. Exported to the processes the command starts")
    parser.add_argument("--node-ip-address", default=None, metavar="ADDR",
                        help=f"the address this node's services listen on and announce: the Ray the command starts "
                             f"(as `ray start --node-ip-address`), the ranks' rendezvous stores (default: "
                             f"${network.ENV_VAR}, else 127.0.0.1 unless MASTER_ADDR names another host). Ray's "
                             "core servers listen on every interface for any address but 127.0.0.1. Exported "
                             "to the processes the command starts")
    commands = parser.add_subparsers(dest="command", metavar="<command>")
    bench_parser = commands.add_parser("bench", help="benchmarks (`flexrl bench --help` lists them)")
    bench = bench_parser.add_subparsers(dest="bench_command", metavar="<benchmark>")
    bench_parser.set_defaults(func=lambda args: _missing_subcommand(bench_parser))
    for module_name in COMMAND_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            if error.name == module_name:  # subsystem not built yet
                continue
            raise
        module.register(commands, bench)
    return parser


def _missing_subcommand(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logs.setup(args.log_level)
    if args.node_ip_address:
        os.environ[network.ENV_VAR] = args.node_ip_address
    if not hasattr(args, "func"):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as error:
        print(f"flexrl {args.command}: error: {error}", file=sys.stderr)
        return 2
    except ValueError as error:
        # Validation errors of configs, workloads and plans are ValueErrors that name the culprit.
        if os.environ.get("FLEXRL_DEBUG") == "1":
            raise
        print(f"flexrl {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
