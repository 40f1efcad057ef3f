"""Rule-based rewards: answer extraction and matching on hand-written responses."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flexrl_ds.rl.rewards import (
    REWARD_FUNCTIONS,
    REWARDS,
    accuracy_reward,
    extract_answer,
    keyword_reward,
    score_responses,
)


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


@pytest.mark.parametrize(
    "response, answer",
    [
        # a letter followed by more than a choice separator is a word or a variable, not a choice
        ("<answer>x = 5</answer>", "x"),
        ("<answer>x=5</answer>", "x"),
        ("<answer>x: 5</answer>", "x"),
        ("<answer>a cat</answer>", "A"),
        ("<answer>A cat</answer>", "A"),
        ("<answer>b the ball</answer>", "B"),
        ("<answer>e.g. the ball</answer>", "E"),
        ("<answer>(b)c</answer>", "B"),
        ("<answer>Bb</answer>", "B"),
        # commas separate thousands only in valid 3-digit groups; otherwise they are text
        ("\\boxed{1,2}", "12"),
        ("\\boxed{1,2,3}", "123"),
        ("\\boxed{12}", "1,2"),
        ("\\boxed{1,0000}", "10000"),
        ("\\boxed{10,00}", "1000"),
        ("\\boxed{,100}", "100"),
        ("\\boxed{1,000,00}", "100000"),
    ],
)
def test_false_positives_score_zero(response, answer):
    assert accuracy_reward(response, answer) == 0.0


@pytest.mark.parametrize(
    "response, answer",
    [
        ("<answer>B) the ball</answer>", "B"),
        ("<answer>(B) the ball</answer>", "b"),
        ("<answer>b.</answer>", "B"),
        ("<answer>x</answer>", "x"),
        ("<answer>C</answer>", "(C)"),
        ("\\boxed{1,000,000}", "1000000"),
        ("\\boxed{-12,345.5}", "-12345.50"),
        ("\\boxed{1e3}", "1,000"),
        ("\\boxed{1,2}", "1,2"),  # equal text still matches
        ("<answer>是</answer>", "是"),  # a one-character non-ASCII answer is text, not a choice letter
        ("<answer>A cat</answer>", "a cat"),
    ],
)
def test_true_positives_still_score_one(response, answer):
    assert accuracy_reward(response, answer) == 1.0


def reference_is_grouped_number(text: str) -> bool:
    """Plain check of the documented rule: digit groups split by commas, the first 1-3 digits, the rest 3."""
    groups = text.split(",")
    return all(group.isdigit() for group in groups) and (
        len(groups) == 1 or (1 <= len(groups[0]) <= 3 and all(len(group) == 3 for group in groups[1:]))
    )


@settings(max_examples=200, deadline=None)
@given(digits=st.text("0123456789", min_size=1, max_size=9),
       cuts=st.sets(st.integers(min_value=0, max_value=9), max_size=4))
def test_commas_count_as_thousands_separators_only_in_valid_groups(digits, cuts):
    with_commas = ",".join(digits[start:stop] for start, stop in zip([0, *sorted(cuts)], [*sorted(cuts), len(digits)]))
    reward = accuracy_reward(f"\\boxed{{{with_commas}}}", digits)
    assert reward == float(reference_is_grouped_number(with_commas)), with_commas
    if reference_is_grouped_number(with_commas):
        assert accuracy_reward(f"\\boxed{{{int(digits):,}}}", with_commas) == 1.0


WORDS = st.from_regex(r"[abcxyz][abcxyz =.]{0,6}", fullmatch=True)
"""Text after a choice letter: it starts with a letter, so "{L}{T}" is one word, never a choice."""


@settings(max_examples=200, deadline=None)
@given(letter=st.sampled_from("abcdexyz"), other=st.sampled_from("abcdexyz"), tail=WORDS,
       form=st.sampled_from(["{L}", "({L})", "{L}.", "{L})", "({L}) {T}", "{L}. {T}", "{L}) {T}", "{L} {T}",
                             "{L}{T}", "{L} = {T}", "{L}: {T}"]))
def test_choice_letters_against_a_plain_reference(letter, other, tail, form):
    predicted = form.format(L=other.upper(), T=tail)
    states_a_choice = form in ("{L}", "({L})", "{L}.", "{L})", "({L}) {T}", "{L}. {T}", "{L}) {T}")
    expected = float(states_a_choice and other == letter)
    assert accuracy_reward(f"<answer>{predicted}</answer>", letter.upper()) == expected, predicted


def reference_keyword_reward(response: str, keyword: str) -> float:
    """Brute force: walk the whitespace-collapsed lower-cased text, taking each keyword copy greedily."""
    text = " ".join(response.lower().split())
    key = " ".join(keyword.lower().split())
    copies, position = 0, 0
    while position < len(text):
        if text[position:position + len(key)] == key:
            copies, position = copies + 1, position + len(key)
        else:
            position += 1
    spelled = sum(not char.isspace() for char in response)
    return 0.0 if spelled == 0 else copies * sum(not char.isspace() for char in key) / spelled


@settings(max_examples=300, deadline=None)
@given(response=st.text("caAtT \n.", max_size=30), keyword_text=st.sampled_from(["cat", "CA", "aa", "a", "c at"]))
def test_keyword_reward_against_a_brute_force_reference(response, keyword_text):
    reward = keyword_reward(response, keyword_text)
    assert reward == pytest.approx(reference_keyword_reward(response, keyword_text), abs=1e-12)
    assert 0.0 <= reward <= 1.0


def test_keyword_reward_examples():
    assert keyword_reward("cat cat", "cat") == 1.0
    assert keyword_reward("Cat\nCAT", "cat") == 1.0
    assert keyword_reward("a cat", "cat") == 0.75
    assert keyword_reward("dog", "cat") == 0.0
    assert keyword_reward("   ", "cat") == 0.0
    assert keyword_reward("aaa", "aa") == pytest.approx(2 / 3)  # copies do not overlap
    with pytest.raises(ValueError, match="keyword"):
        keyword_reward("cat", "  ")


def test_builtin_rewards_take_the_batch_signature():
    assert set(REWARDS) >= {"accuracy", "keyword"}
    records = [{"id": "r0", "answer": "42"}, {"id": "r1", "answer": "B", "data_source": "nextqa"},
               {"id": "r2", "answer": 7}]
    responses = ["\\boxed{42}", "<answer>b) ball</answer>", "\\boxed{7.0}"]
    assert REWARDS["accuracy"](responses, records) == [accuracy_reward(r, str(rec["answer"]))
                                                       for r, rec in zip(responses, records)] == [1.0, 1.0, 1.0]
    assert REWARDS["keyword"](["ball ball", "x"], [{"answer": "ball"}, {"answer": "ball"}]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="record 'r9' has no 'answer'"):
        REWARDS["accuracy"](["x"], [{"id": "r9"}])
    with pytest.raises(ValueError, match=r"record 'r8': 'answer' must be a string .* got \['a'\]"):
        REWARDS["keyword"](["x"], [{"id": "r8", "answer": ["a"]}])
