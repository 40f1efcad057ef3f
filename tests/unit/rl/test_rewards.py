"""Rule-based rewards: answer extraction and matching on hand-written responses."""

from __future__ import annotations

import pytest

from flexrl_ds.rl.rewards import REWARD_FUNCTIONS, accuracy_reward, extract_answer, score_responses


@pytest.mark.parametrize(
    "response, expected",
    [
        ("so the angle is \\boxed{42}.", "42"),
        ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("<think>maybe 3</think><answer> B </answer>", "B"),
        ("<answer>1</answer> later <answer>\\boxed{7}</answer>", "7"),
        ("no final answer here", None),
        ("broken \\boxed{12", None),
    ],
)
def test_extract_answer(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize(
    "response, answer, reward",
    [
        ("\\boxed{42}", "42", 1.0),
        ("\\boxed{42.0}", "42", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{41}", "42", 0.0),
        ("<answer>B. the boy wanted to play</answer>", "B", 1.0),
        ("<answer>(b)</answer>", "B", 1.0),
        ("<answer>about</answer>", "A", 0.0),
        ("<answer>C</answer>", "B", 0.0),
        ("<answer> $Paris$. </answer>", "paris", 1.0),
        ("<answer>new   york</answer>", "New York", 1.0),
        ("the answer is 42", "42", 0.0),  # no tag, no box: no credit
    ],
)
def test_accuracy_reward(response, answer, reward):
    assert accuracy_reward(response, answer) == reward


def test_score_responses_uses_the_source_and_names_bad_samples():
    REWARD_FUNCTIONS["always_half"] = lambda response, answer: 0.5
    try:
        rewards = score_responses(["\\boxed{1}", "\\boxed{2}", "x"], ["1", "1", "y"], [None, "geo3k", "always_half"])
    finally:
        del REWARD_FUNCTIONS["always_half"]
    assert rewards == [1.0, 0.0, 0.5]
    with pytest.raises(ValueError, match="sample 1: the record has no 'answer'"):
        score_responses(["a", "b"], ["a", None], [None, "nextqa"])
    with pytest.raises(ValueError, match="2 responses, 1 answers"):
        score_responses(["a", "b"], ["a"], [None, None])
