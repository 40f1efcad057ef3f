"""Rule-based (verifiable) rewards: a response's final answer against the record's `answer` (pure).

A record's `data_source` picks the reward function (data-format.md); sources not registered in
`REWARD_FUNCTIONS` use `"default"`. The final answer of a response is the content of its last
`<answer>...</answer>` tag, else of its last `\\boxed{...}` (nested braces allowed), else None
(reward 0). Comparison: multiple-choice letters by letter ("B", "(b)", "B. the ball" all mean B),
numbers by value (1e-6 relative; "1,000" and "1000.0" match), otherwise case- and space-insensitive
text with surrounding `$`, trailing periods and outer spaces removed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_CHOICE = re.compile(r"^\(?([A-Za-z])\)?(?:[.):]|\s|$)")
_NUMBER = re.compile(r"^[-+]?(\d[\d,]*\.?\d*|\.\d+)(e[-+]?\d+)?$", re.IGNORECASE)


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index]
            depth -= 1
    return None  # unbalanced: no answer


def extract_answer(response: str) -> str | None:
    """The response's final answer (see the module docstring), or None."""
    tags = _ANSWER_TAG.findall(response)
    if tags:
        inner = _last_boxed(tags[-1])
        return (inner if inner is not None else tags[-1]).strip()
    boxed = _last_boxed(response)
    return None if boxed is None else boxed.strip()


def normalize_answer(text: str) -> str:
    """Lower-cased text without surrounding `$`/spaces, trailing periods or inner whitespace runs."""
    text = text.strip().rstrip(".").strip().strip("$").strip().rstrip(".").strip()
    return re.sub(r"\s+", " ", text).lower()


def _as_number(text: str) -> float | None:
    if not _NUMBER.match(text):
        return None
    value = float(text.replace(",", ""))
    return value if math.isfinite(value) else None


def answers_match(predicted: str, expected: str) -> bool:
    """True when `predicted` and the reference `expected` mean the same answer."""
    predicted, expected = normalize_answer(predicted), normalize_answer(expected)
    if len(expected) == 1 and expected.isalpha():
        choice = _CHOICE.match(predicted)
        return choice is not None and choice.group(1).lower() == expected
    expected_number, predicted_number = _as_number(expected), _as_number(predicted)
    if expected_number is not None and predicted_number is not None:
        return math.isclose(predicted_number, expected_number, rel_tol=1e-6, abs_tol=1e-9)
    return predicted == expected


def accuracy_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer matches `answer`, else 0.0."""
    predicted = extract_answer(response)
    return float(predicted is not None and answers_match(predicted, answer))


REWARD_FUNCTIONS: dict[str, Callable[[str, str], float]] = {"default": accuracy_reward}
"""data_source -> reward(response, answer); "default" serves every source not listed."""


def score_responses(
    responses: Sequence[str],
    answers: Sequence[str | None],
    data_sources: Sequence[str | None],
) -> list[float]:
    """One reward per response (sample order); ValueError naming the sample for a missing answer."""
    if not len(responses) == len(answers) == len(data_sources):
        raise ValueError(
            f"score_responses: {len(responses)} responses, {len(answers)} answers, {len(data_sources)} data sources"
        )
    rewards = []
    for index, (response, answer, source) in enumerate(zip(responses, answers, data_sources)):
        if answer is None:
            raise ValueError(f"sample {index}: the record has no 'answer' to reward against (data_source {source!r})")
        reward_function = REWARD_FUNCTIONS.get(source or "default", REWARD_FUNCTIONS["default"])
        rewards.append(float(reward_function(response, answer)))
    return rewards
