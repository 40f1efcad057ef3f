"""A reward function that hangs: each call is given up after `flexrl.rl.reward_timeout_s`; the
samples it hangs on score 0 and are reported, the others are scored as a plain per-sample loop would."""

from __future__ import annotations

import threading
import time

import pytest

from flexrl_ds.rl.config import GRPOConfig
from flexrl_ds.rl.reward_fn import TIMEOUTS_IN_A_ROW, score_batch

LIMIT_S = 0.5  # a good sample's call must finish within it, also on a loaded machine
RELEASE = threading.Event()  # set at the end of every test: no hung thread outlives it


@pytest.fixture(autouse=True)
def _release_hung_calls():
    RELEASE.clear()
    yield
    RELEASE.set()


def _length(response: str) -> float:
    return float(len(response))


def hangs_on(bad: set[str]):
    def reward(responses, records):
        if bad & set(responses):
            RELEASE.wait(30)
        return [_length(response) for response in responses]
    return reward


def test_a_call_that_hangs_on_one_sample_zeroes_only_that_sample():
    responses, ids = ["a", "bb", "hang", "dddd"], ["s0", "s1", "s2", "s3"]
    started = time.perf_counter()
    scored = score_batch(hangs_on({"hang"}), responses, [{}] * 4, ids, timeout_s=LIMIT_S)
    elapsed = time.perf_counter() - started
    reference = [0.0 if response == "hang" else _length(response) for response in responses]
    assert scored.scores == reference
    assert list(scored.errors) == ["s2"] and "timed out" in scored.errors["s2"]
    assert "reward_timeout_s" in scored.errors["s2"] and "timed out" in scored.batch_error
    assert elapsed < 2 * LIMIT_S + 1.0  # the batch call's limit, then the one sample's


def test_a_prompt_group_that_hangs_after_a_good_sample_costs_only_its_own_samples():
    """Samples of one prompt sit together: two hangs in a row after a call that returned do not end
    the scoring of the rest."""
    responses = ["a", "b", "hang", "hang2", "c", "d"]
    ids = [f"s{i}" for i in range(6)]
    scored = score_batch(hangs_on({"hang", "hang2"}), responses, [{}] * 6, ids, timeout_s=LIMIT_S)
    assert scored.scores == [0.0 if r.startswith("hang") else _length(r) for r in responses]
    assert sorted(scored.errors) == ["s2", "s3"]


def test_a_function_that_always_hangs_is_given_up_after_a_few_limits():
    ids = [f"s{i}" for i in range(20)]
    started = time.perf_counter()
    scored = score_batch(hangs_on(set(ids)), ids, [{}] * 20, ids, timeout_s=LIMIT_S)
    elapsed = time.perf_counter() - started
    assert scored.all_failed() and scored.scores == [0.0] * 20
    assert elapsed < (1 + TIMEOUTS_IN_A_ROW) * LIMIT_S + 1.0
    assert all("timed out" in scored.errors[i] for i in ids[:TIMEOUTS_IN_A_ROW])
    assert all("not scored" in scored.errors[i] for i in ids[TIMEOUTS_IN_A_ROW:])
    assert scored.raised_at is None


def test_a_fast_function_under_a_limit_scores_as_without_one():
    responses = ["x" * k for k in range(6)]
    ids = [f"s{k}" for k in range(6)]
    bounded = score_batch(hangs_on(set()), responses, [{}] * 6, ids, timeout_s=5.0)
    unbounded = score_batch(hangs_on(set()), responses, [{}] * 6, ids)
    assert bounded.scores == unbounded.scores == [_length(r) for r in responses] and not bounded.errors


def test_a_raising_function_under_a_limit_still_says_where_it_raised():
    def reward(responses, records):
        raise KeyError("answer")

    scored = score_batch(reward, ["a"], [{}], ["s0"], timeout_s=5.0)
    assert scored.errors == {"s0": "KeyError: 'answer'"} and "test_reward_timeout.py" in scored.raised_at


@pytest.mark.parametrize("value", [0, -1.0])
def test_the_limit_must_be_positive(value):
    with pytest.raises(ValueError, match="flexrl.rl.reward_timeout_s"):
        GRPOConfig(reward_timeout_s=value)
    assert GRPOConfig(reward_timeout_s=None).reward_timeout_s is None
