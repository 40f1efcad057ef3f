"""Reward functions by spec (`flexrl.rl.reward_fn`) and fault-tolerant batch scoring (pure).

A spec is a built-in name (`rewards.REWARDS`: "accuracy", "keyword") or `"path/to/file.py:name"`, a
function in a Python file, loaded with importlib (a relative path is taken against `base_dir`, else
the current directory). A reward function has the signature

    def name(responses: list[str], records: list[dict]) -> list[float]

the responses' text in sample order and each sample's dataset record (its JSON fields: id, prompt,
answer, data_source, images, videos and any extra column), one float per response. It should not
mutate the records. The file is imported once per `load_reward_fn` call, as a module of its own
(registered in `sys.modules` under a name derived from its path, so dataclasses in it work); its
folder is not put on `sys.path`. Call the function in the process that loaded it (the driver); another
process loads it again from the spec (the module name is not importable elsewhere).

`score_batch` calls the function on the whole batch; if that raises, it calls it once per sample, so
only the samples that fail score 0. Returned values are checked: a result of the wrong length makes
every sample of that call score 0; a value that is not a real number, or is NaN or infinite, makes
its sample score 0. Every such sample is reported in `RewardBatch.errors` with the reason, and the
run goes on, unless every sample of a step failed: the trainer then stops (driver.py `_reward`),
naming where the function raised (`RewardBatch.raised_at`).

With `timeout_s` (`flexrl.rl.reward_timeout_s`) each call runs in a daemon thread and is given up
after that many seconds: a batch call that hangs is retried per sample like one that raised, each
sample's call with the same limit, and the samples whose call hangs score 0 "timed out"; when the
first `TIMEOUTS_IN_A_ROW` sample calls all time out (none returned) the function is taken to hang on
any input and the remaining samples score 0 unscored (a function that always hangs costs a step at
most three limits, then the step's every sample has failed and the run stops; one that hangs only on
some records costs one limit per sample it hangs on, unless those come first). Python cannot stop a thread: a call given
up on goes on in the background until it returns (or the process ends), so a function that hangs
should not hold locks the next call needs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import math
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flexrl_ds.rl.rewards import REWARDS

RewardFn = Callable[[list[str], list[dict]], list[float]]
"""A batch reward function: (responses, records) -> one float per response."""


def _import_file(spec: str, path: Path):
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:12]
    module_name = f"flexrl_reward_{path.stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"flexrl.rl.reward_fn {spec!r}: {path} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[module_name] = module
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as error:
        del sys.modules[module_name]
        raise ValueError(
            f"flexrl.rl.reward_fn {spec!r}: importing {path} failed: {type(error).__name__}: {error}"
        ) from error
    return module


def _check_signature(spec: str, function: Callable) -> None:
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return  # no introspectable signature (some builtins): trust it
    try:
        signature.bind([], [])
    except TypeError as error:
        raise ValueError(
            f"flexrl.rl.reward_fn {spec!r}: the function must accept (responses, records), "
            f"but its signature is {signature} ({error})"
        ) from None


def load_reward_fn(spec: str, base_dir: str | None = None) -> RewardFn:
    """The reward function `spec` names (module docstring); ValueError naming the spec and the reason."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"flexrl.rl.reward_fn: expected a built-in name or 'path/to/file.py:name', got {spec!r}")
    if ":" not in spec:
        if spec in REWARDS:
            return REWARDS[spec]
        hint = " (a file needs ':function_name' after it)" if spec.endswith(".py") else ""
        raise ValueError(
            f"flexrl.rl.reward_fn {spec!r}: not a built-in reward{hint}; built-ins: {', '.join(sorted(REWARDS))}, "
            "or give 'path/to/file.py:function_name'"
        )
    file_part, name = spec.rsplit(":", 1)
    if not file_part or not name.isidentifier():
        raise ValueError(f"flexrl.rl.reward_fn {spec!r}: expected 'path/to/file.py:function_name'")
    path = Path(file_part).expanduser()
    if not path.is_absolute():
        path = Path(base_dir if base_dir is not None else Path.cwd()) / path
    path = path.resolve()
    if not path.is_file():
        raise ValueError(f"flexrl.rl.reward_fn {spec!r}: reward file {path} does not exist")
    module = _import_file(spec, path)
    if not hasattr(module, name):
        defined = sorted(key for key, value in vars(module).items() if callable(value) and not key.startswith("_"))
        raise ValueError(f"flexrl.rl.reward_fn {spec!r}: {path} defines no {name!r} (callables there: {defined})")
    function = getattr(module, name)
    if not callable(function):
        kind = type(function).__name__
        raise ValueError(f"flexrl.rl.reward_fn {spec!r}: {name!r} in {path} is a {kind}, not callable")
    _check_signature(spec, function)
    return function


def check_reward_spec(spec: str, base_dir: str | None = None) -> None:
    """Raise the ValueError `load_reward_fn` would, before any worker starts (imports the file)."""
    load_reward_fn(spec, base_dir)


@dataclass
class RewardBatch:
    """Rewards of one batch: a score per response, and why the samples that scored 0 by failure did."""

    scores: list[float]
    """One reward per response, in sample order; 0.0 for a failed sample."""
    errors: dict[str, str] = field(default_factory=dict)
    """sample id -> why its reward failed (the exception, or the bad returned value)."""
    batch_error: str | None = None
    """The error of the whole-batch call when it raised and the samples were scored one by one."""
    raised_at: str | None = None
    """Where the call of the first sample that failed by raising raised (file:line in function: the
    innermost frame in the reward function's own file, else the innermost); None if none did."""
    raised_by: str | None = None
    """That sample's id."""

    def all_failed(self) -> bool:
        return bool(self.scores) and len(self.errors) == len(self.scores)

    def messages(self) -> list[str]:
        """One line per failed sample, for logs."""
        return [f"reward of sample {sample_id!r} failed, scored 0: {error}" for sample_id, error in self.errors.items()]


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def _raised_at(error: BaseException, reward_fn: RewardFn) -> str | None:
    frames = traceback.extract_tb(error.__traceback__)
    own_file = getattr(getattr(reward_fn, "__code__", None), "co_filename", None)
    own = [frame for frame in frames if frame.filename == own_file]
    frame = (own or frames or [None])[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}" if frame else None


def _as_score(value: object) -> float | str:
    """The value as a finite float, or the reason it is not one."""
    if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
        return f"returned {value!r} ({type(value).__name__}), not a number"
    try:
        score = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError) as error:
        return f"returned {value!r}, not a number ({error})"
    return score if math.isfinite(score) else f"returned {score}, not a finite number"


def _validated(result: object, ids: list[str]) -> tuple[list[float], dict[str, str]]:
    """Scores of one call's result for samples `ids`, and the errors of those that are bad."""
    unordered_or_text = isinstance(result, (str, bytes, dict, set, frozenset))
    try:
        values = None if unordered_or_text else list(result)  # type: ignore[call-overload]
    except TypeError:
        values = None
    if values is None:
        reason = f"the reward function returned {type(result).__name__}, not a list of floats"
        return [0.0] * len(ids), {i: reason for i in ids}
    if len(values) != len(ids):
        reason = f"the reward function returned {len(values)} values for {len(ids)} responses"
        return [0.0] * len(ids), {i: reason for i in ids}
    scores, errors = [], {}
    for sample_id, value in zip(ids, values):
        score = _as_score(value)
        if isinstance(score, str):
            errors[sample_id] = score
            score = 0.0
        scores.append(score)
    return scores, errors


TIMEOUTS_IN_A_ROW = 2
"""Sample calls that time out, with none returned before them, before the rest of a batch is left
unscored (module docstring)."""


class RewardTimeout(Exception):
    """A reward call that did not return within `flexrl.rl.reward_timeout_s`."""


def _bounded(reward_fn: RewardFn, responses: list[str], records: list[dict], timeout_s: float | None):
    """`reward_fn(responses, records)`, given up after `timeout_s` seconds (RewardTimeout)."""
    if timeout_s is None:
        return reward_fn(responses, records)
    outcome: dict[str, object] = {}

    def call() -> None:
        try:
            outcome["value"] = reward_fn(responses, records)
        except BaseException as error:  # handed to the caller's thread, which reports it
            outcome["error"] = error

    thread = threading.Thread(target=call, name="flexrl-reward-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardTimeout(f"timed out: no result within {timeout_s:g} s (flexrl.rl.reward_timeout_s)")
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]


def _call(reward_fn: RewardFn, responses: list[str], records: list[dict], ids: list[str],
          timeout_s: float | None = None):
    """((scores, errors), None, None) or (None, the error, where it was raised; None for a timeout)."""
    try:
        return _validated(_bounded(reward_fn, list(responses), list(records), timeout_s), ids), None, None
    except RewardTimeout as error:
        return None, str(error), None
    except Exception as error:  # a user's reward function may raise anything: report, never crash
        return None, _describe(error), _raised_at(error, reward_fn)


def score_batch(reward_fn: RewardFn, responses: Sequence[str], records: Sequence[dict],
                sample_ids: Sequence[str], timeout_s: float | None = None) -> RewardBatch:
    """Rewards of a batch, fault tolerant (module docstring): failed samples score 0 and are reported;
    `timeout_s`: the longest wait for one call (None: no limit)."""
    if not len(responses) == len(records) == len(sample_ids):
        raise ValueError(
            f"score_batch: {len(responses)} responses, {len(records)} records, {len(sample_ids)} sample ids"
        )
    ids = list(sample_ids)
    if len(set(ids)) != len(ids):
        raise ValueError(f"score_batch: sample ids are not unique: {sorted({i for i in ids if ids.count(i) > 1})}")
    if not ids:
        return RewardBatch(scores=[])
    whole, batch_error, _ = _call(reward_fn, list(responses), list(records), ids, timeout_s)
    if whole is not None:
        return RewardBatch(scores=whole[0], errors=whole[1])
    batch = RewardBatch(scores=[], batch_error=batch_error)
    timeouts, returned = 0, False
    for response, record, sample_id in zip(responses, records, ids):
        if timeouts >= TIMEOUTS_IN_A_ROW and not returned:
            batch.scores.append(0.0)
            batch.errors[sample_id] = (f"not scored: the reward function's first {TIMEOUTS_IN_A_ROW} calls on single "
                                       "samples timed out, so it is taken to hang on any input")
            continue
        single, error, where = _call(reward_fn, [response], [record], [sample_id], timeout_s)
        timed_out = single is None and where is None and error.startswith("timed out")
        timeouts, returned = timeouts + timed_out, returned or not timed_out
        if single is None:
            batch.scores.append(0.0)
            batch.errors[sample_id] = error
            if batch.raised_at is None and where is not None:
                batch.raised_at, batch.raised_by = where, sample_id
        else:
            batch.scores.extend(single[0])
            batch.errors.update(single[1])
    return batch
