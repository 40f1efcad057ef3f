"""Reward functions by spec (built-in or file) and fault-tolerant batch scoring, against plain loops."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexrl_ds.rl.reward_fn import RewardBatch, check_reward_spec, load_reward_fn, score_batch
from flexrl_ds.rl.rewards import REWARDS


def write(tmp_path, name: str, source: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


GOOD_FILE = """
    from dataclasses import dataclass

    @dataclass
    class Weight:
        value: float

    WEIGHT = Weight(2.0)

    def length_reward(responses, records):
        return [WEIGHT.value * len(response) for response in responses]

    not_a_function = 3

    def one_argument(responses):
        return [0.0] * len(responses)
"""


def test_builtin_names_give_the_builtin_functions():
    for name, function in REWARDS.items():
        assert load_reward_fn(name) is function
        check_reward_spec(name)


def test_a_file_function_loads_by_absolute_and_relative_path(tmp_path, monkeypatch):
    path = write(tmp_path, "my_reward.py", GOOD_FILE)
    absolute = load_reward_fn(f"{path}:length_reward")
    assert absolute(["ab", "abcd"], [{}, {}]) == [4.0, 8.0]
    relative = load_reward_fn("my_reward.py:length_reward", base_dir=str(tmp_path))
    assert relative(["abc"], [{}]) == [6.0]
    monkeypatch.chdir(tmp_path)
    assert load_reward_fn("./my_reward.py:length_reward")(["a"], [{}]) == [2.0]
    check_reward_spec("my_reward.py:length_reward")


@pytest.mark.parametrize(
    "spec, match",
    [
        ("acuracy", r"'acuracy': not a built-in reward; built-ins: accuracy, keyword"),
        ("my_reward.py", r"not a built-in reward \(a file needs ':function_name'"),
        ("", "expected a built-in name"),
        ("my_reward.py:", "expected 'path/to/file.py:function_name'"),
        (":length_reward", "expected 'path/to/file.py:function_name'"),
        ("missing.py:length_reward", r"'missing.py:length_reward': reward file .*missing.py does not exist"),
        ("my_reward.py:nothing_here", r"defines no 'nothing_here' \(callables there: .*'length_reward'"),
        ("my_reward.py:not_a_function", "'not_a_function' in .* is a int, not callable"),
        ("my_reward.py:one_argument", r"must accept \(responses, records\), but its signature is \(responses\)"),
        ("raises.py:f", r"'raises.py:f': importing .*raises.py failed: RuntimeError: no GPU here"),
        ("syntax.py:f", r"importing .*syntax.py failed: SyntaxError"),
        ("exits.py:f", r"importing .*exits.py failed: SystemExit: 3"),
    ],
)
def test_bad_specs_raise_naming_the_spec_and_the_reason(tmp_path, spec, match):
    write(tmp_path, "my_reward.py", GOOD_FILE)
    write(tmp_path, "raises.py", "raise RuntimeError('no GPU here')\ndef f(responses, records): pass\n")
    write(tmp_path, "syntax.py", "def f(responses, records):\n    return [\n")
    write(tmp_path, "exits.py", "import sys\nsys.exit(3)\n")
    with pytest.raises(ValueError, match=match):
        load_reward_fn(spec, base_dir=str(tmp_path))
    with pytest.raises(ValueError, match=match):
        check_reward_spec(spec, base_dir=str(tmp_path))


def test_a_failed_import_leaves_no_half_module_behind(tmp_path):
    write(tmp_path, "raises.py", "raise RuntimeError('boom')\n")
    before = set(sys.modules)
    with pytest.raises(ValueError):
        load_reward_fn("raises.py:f", base_dir=str(tmp_path))
    assert set(sys.modules) == before


def test_a_good_batch_scores_as_a_plain_loop():
    records = [{"id": f"p{i}", "answer": answer} for i, answer in enumerate(["42", "B", "cat"])]
    responses = ["\\boxed{42}", "<answer>a cat</answer>", "cat"]
    result = score_batch(REWARDS["accuracy"], responses, records, ["s0", "s1", "s2"])
    assert result == RewardBatch(scores=[1.0, 0.0, 0.0], errors={}, batch_error=None)


def test_a_raising_sample_scores_zero_and_is_reported_the_others_are_scored():
    calls = []

    def reward(responses, records):
        calls.append(len(responses))
        for record in records:
            if record["answer"] == "bad":
                raise KeyError("no such column 'difficulty'")
        return [float(len(response)) for response in responses]

    records = [{"answer": "ok"}, {"answer": "bad"}, {"answer": "ok"}]
    result = score_batch(reward, ["a", "bb", "ccc"], records, ["s0", "s1", "s2"])
    assert result.scores == [1.0, 0.0, 3.0]
    assert result.errors == {"s1": "KeyError: \"no such column 'difficulty'\""}
    assert result.batch_error == "KeyError: \"no such column 'difficulty'\""
    assert calls == [3, 1, 1, 1]  # the batch once, then once per sample
    assert result.messages() == ["reward of sample 's1' failed, scored 0: KeyError: \"no such column 'difficulty'\""]


def test_the_accuracy_builtin_reports_a_record_without_answer_and_scores_the_rest():
    records = [{"id": "p0", "answer": "1"}, {"id": "p1"}, {"id": "p2", "answer": "3"}]
    result = score_batch(REWARDS["accuracy"], ["\\boxed{1}", "\\boxed{2}", "\\boxed{3}"], records, ["a", "b", "c"])
    assert result.scores == [1.0, 0.0, 1.0]
    assert list(result.errors) == ["b"] and "record 'p1' has no 'answer'" in result.errors["b"]


def test_a_function_that_fails_only_on_batches_is_scored_per_sample_without_sample_errors():
    def single_only(responses, records):
        if len(responses) > 1:
            raise RuntimeError("batching not supported")
        return [0.5]

    result = score_batch(single_only, ["a", "b"], [{}, {}], ["s0", "s1"])
    assert result == RewardBatch(scores=[0.5, 0.5], errors={}, batch_error="RuntimeError: batching not supported")


@pytest.mark.parametrize("returned", [[1.0], [1.0, 2.0, 3.0], [], 1.0, None, "12", {0: 1.0, 1: 1.0}])
def test_a_result_of_the_wrong_length_or_type_zeroes_the_whole_call(returned):
    result = score_batch(lambda responses, records: returned, ["a", "b"], [{}, {}], ["s0", "s1"])
    assert result.scores == [0.0, 0.0]
    assert set(result.errors) == {"s0", "s1"}
    assert all("the reward function returned" in error for error in result.errors.values())


def test_bad_values_zero_only_their_samples():
    numpy = pytest.importorskip("numpy")
    values = [0.25, math.nan, math.inf, -math.inf, None, "1.0", True, numpy.float32(0.5), numpy.int64(2), [1.0]]
    ids = [f"s{i}" for i in range(len(values))]
    result = score_batch(lambda responses, records: values, ["r"] * len(values), [{}] * len(values), ids)
    assert result.scores == [0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5, 2.0, 0.0]
    assert set(result.errors) == {"s1", "s2", "s3", "s4", "s5", "s9"}
    assert "not a finite number" in result.errors["s1"] and "not a number" in result.errors["s5"]


def test_a_tensor_result_is_read_by_value():
    torch = pytest.importorskip("torch")
    as_tensor = lambda responses, records: torch.tensor([0.5, float("nan")])  # noqa: E731
    result = score_batch(as_tensor, ["a", "b"], [{}, {}], ["s0", "s1"])
    assert result.scores == [0.5, 0.0] and list(result.errors) == ["s1"]


def test_the_function_gets_its_own_lists_and_bad_inputs_are_rejected():
    responses, records = ["a", "b"], [{"id": 1}, {"id": 2}]

    def reorders(got_responses, got_records):
        got_responses.reverse()
        got_records.clear()
        return [1.0, 2.0]

    assert score_batch(reorders, responses, records, ["x", "y"]).scores == [1.0, 2.0]
    assert responses == ["a", "b"] and records == [{"id": 1}, {"id": 2}]
    with pytest.raises(ValueError, match="2 responses, 2 records, 1 sample ids"):
        score_batch(reorders, responses, records, ["x"])
    with pytest.raises(ValueError, match=r"not unique: \['x'\]"):
        score_batch(reorders, responses, records, ["x", "x"])
    assert score_batch(reorders, [], [], []) == RewardBatch(scores=[])


OUTCOMES = st.sampled_from(["value", "raise", "nan", "text"])


@settings(max_examples=150, deadline=None)
@given(plan=st.lists(st.tuples(OUTCOMES, st.floats(-10, 10, allow_nan=False)), max_size=8))
def test_score_batch_against_a_plain_per_sample_reference(plan):
    """Each record says what the function does for it; the reference applies that sample by sample."""
    records = [{"outcome": outcome, "value": value} for outcome, value in plan]

    def reward(responses, records):
        if any(record["outcome"] == "raise" for record in records):
            raise ValueError("cannot score")
        return [{"value": r["value"], "nan": math.nan, "text": "high"}[r["outcome"]] for r in records]

    ids = [f"s{i}" for i in range(len(plan))]
    result = score_batch(reward, [""] * len(plan), records, ids)
    expected_scores = [value if outcome == "value" else 0.0 for outcome, value in plan]
    expected_failed = {sample_id for sample_id, (outcome, _) in zip(ids, plan) if outcome != "value"}
    assert result.scores == expected_scores
    assert set(result.errors) == expected_failed
    assert (result.batch_error is not None) == any(outcome == "raise" for outcome, _ in plan)
