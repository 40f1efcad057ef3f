"""Calls across processes name the worker's method itself (`group.run(PolicyWorker.logprobs, job)`),
never a string: a reader, an IDE and the type checker can follow the call to the method."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from flexrl_ds.runtime.worker_group import remote_name

PACKAGE = Path(__file__).resolve().parents[2] / "flexrl_ds"
GROUP_CALLS = {"run", "run_each", "run_async", "run_each_async", "collective_rpc"}
"""Methods of the worker groups (runtime/) and vLLM's `LLM.collective_rpc` that take a worker method."""


def _string_named_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each call that names a worker method by a string: `group.run("x", ...)`, or a
    group's method passed on with its string (`self._timed(times, name, self.policy.run, "x", job)`)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        if isinstance(node.func, ast.Attribute) and node.func.attr in GROUP_CALLS and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append((node.lineno, first.value))
        for passed, following in zip(node.args, node.args[1:]):
            if (isinstance(passed, ast.Attribute) and passed.attr in GROUP_CALLS
                    and isinstance(following, ast.Constant) and isinstance(following.value, str)):
                found.append((node.lineno, following.value))
    return found


def test_no_call_site_names_a_worker_method_by_a_string():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        offenders += [f"{path.relative_to(PACKAGE.parent)}:{line}: {name!r}" for line, name in _string_named_calls(tree)]
    assert not offenders, "pass the worker's method itself, not its name:\n" + "\n".join(offenders)


def test_the_scan_finds_both_spellings():
    source = 'group.run("logprobs", job)\nself._timed(times, "old", self.policy.run, "train", job)\n'
    assert [name for _, name in _string_named_calls(ast.parse(source))] == ["logprobs", "train"]


class _Worker:
    def ping(self) -> int:
        return 0


class _Other:
    def ping(self) -> int:
        return 1


def test_the_name_sent_is_the_methods_and_the_class_is_checked():
    assert remote_name(_Worker, _Worker.ping) == "ping"
    assert remote_name(None, _Other.ping) == "ping"  # a group built by a factory function: not checked
    with pytest.raises(TypeError, match="method itself"):
        remote_name(_Worker, "ping")
    with pytest.raises(TypeError, match="_Other.ping is not a method of the group's worker class _Worker"):
        remote_name(_Worker, _Other.ping)
