"""Built-in rewards (pure): the rule reward against the record's `answer`, and a keyword reward.

`REWARDS` holds the built-ins by name, each with the batch signature of a custom reward function
(`flexrl.rl.reward_fn`, see `reward_fn.py`): `(responses: list[str], records: list[dict]) -> list[float]`.

**accuracy** (the rule reward). A record's `data_source` picks the per-sample function
(docs/DATA_FORMAT.md); sources not registered in `REWARD_FUNCTIONS` use `"default"`. The final answer of a
response is the content of its last `<answer>...</answer>` tag, else of its last `\\boxed{...}`
(nested braces allowed), else None (reward 0). Both sides are normalised (`normalize_answer`:
lower-cased, surrounding `$`, trailing periods and outer spaces removed, whitespace runs collapsed),
then compared in the first way that applies:
- a reference that is one ASCII letter (or "(b)") is a multiple-choice letter. The prediction means
  that letter when it is the letter alone, "(b)", "b." or "b)", the last three optionally followed
  by a space and text ("B. the ball"). A letter followed by anything else is not a choice: "a cat",
  "x = 5", "x=5" and "e.g." do not mean A, X or E;
- when both sides are numbers they match by value (relative 1e-6). A number is an optional sign,
  digits, an optional fraction and an optional exponent. A comma is a thousands separator only in
  valid 3-digit grouping: "1,000" and "12,345.5" are numbers, "1,2", "1,2,3" and "1,0000" are not,
  so they are compared as text ("1,2" is not "12");
- otherwise the normalised texts must be equal.

**keyword** (a dense reward that even a tiny random model can earn, for demos). The record's
`answer` is a keyword; the reward is the share of the response's non-whitespace characters that are
spelled by non-overlapping, case-insensitive copies of the keyword (whitespace runs count as one
space): "cat cat" and "catcat" score 1,
"a cat" scores 3/4, a response without the keyword 0. It rewards saying the keyword and nothing else:
an honest, checkable task with a signal from the first step (random text contains the keyword now
and then), not a measure of understanding.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_CHOICE = re.compile(r"^(?:([a-z])|\(([a-z])\)(?:\s.*)?|([a-z])[.)](?:\s.*)?)$", re.DOTALL)
_REFERENCE_CHOICE = re.compile(r"^\(?([a-z])\)?$")
_NUMBER = re.compile(r"^[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?$", re.IGNORECASE)


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


def _choice_letter(normalized: str) -> str | None:
    """The multiple-choice letter a normalised prediction states ("b", "(b) ...", "b. ..."), or None."""
    match = _CHOICE.match(normalized)
    return None if match is None else next(group for group in match.groups() if group)


def answers_match(predicted: str, expected: str) -> bool:
    """True when `predicted` and the reference `expected` mean the same answer."""
    predicted, expected = normalize_answer(predicted), normalize_answer(expected)
    reference_choice = _REFERENCE_CHOICE.match(expected)
    if reference_choice is not None:
        return _choice_letter(predicted) == reference_choice.group(1)
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


def _source_reward(response: str, answer: str, source: str | None) -> float:
    return float(REWARD_FUNCTIONS.get(source or "default", REWARD_FUNCTIONS["default"])(response, answer))


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
        rewards.append(_source_reward(response, answer, source))
    return rewards


def record_answer(record: dict) -> str:
    """The record's `answer` as text (JSON numbers are accepted); ValueError naming the record if absent."""
    answer = record.get("answer")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return str(answer)
    if answer is None:
        raise ValueError(f"record {record.get('id')!r} has no 'answer' to reward against")
    if not isinstance(answer, str):
        raise ValueError(f"record {record.get('id')!r}: 'answer' must be a string to reward against, got {answer!r}")
    return answer


def accuracy(responses: list[str], records: list[dict]) -> list[float]:
    """Built-in "accuracy": the rule reward of each response against its record's `answer`, by `data_source`."""
    assert len(responses) == len(records), (len(responses), len(records))
    return [_source_reward(response, record_answer(record), record.get("data_source"))
            for response, record in zip(responses, records)]


def keyword_reward(response: str, keyword: str) -> float:
    """Share of the response's non-whitespace characters spelled by copies of `keyword` (module docstring)."""
    keyword = re.sub(r"\s+", " ", keyword.strip().lower())
    if not keyword:
        raise ValueError("keyword reward: the keyword (the record's 'answer') is empty")
    spelled = len(re.sub(r"\s+", "", response))
    if spelled == 0:
        return 0.0
    copies = re.sub(r"\s+", " ", response.lower()).count(keyword)
    return copies * len(keyword.replace(" ", "")) / spelled


def keyword(responses: list[str], records: list[dict]) -> list[float]:
    """Built-in "keyword": `keyword_reward` of each response with its record's `answer` as the keyword."""
    assert len(responses) == len(records), (len(responses), len(records))
    return [keyword_reward(response, record_answer(record)) for response, record in zip(responses, records)]


def keyword_letters_reward(response: str, keyword: str) -> float:
    """A dense shaping of `keyword_reward`: the mean of (a) the share of the response's letters that
    are letters of `keyword` and (b) `keyword_reward`. Random text already earns some of (a), so
    GRPO has signal from the first step; only copies of the keyword itself reach 1."""
    letters = [ch for ch in response.lower() if ch.isalpha()]
    allowed = set(keyword.lower())
    share = sum(ch in allowed for ch in letters) / len(letters) if letters else 0.0
    return 0.5 * share + 0.5 * keyword_reward(response, keyword)


def keyword_letters(responses: list[str], records: list[dict]) -> list[float]:
    """Built-in "keyword_letters": `keyword_letters_reward` with the record's `answer` as the keyword."""
    assert len(responses) == len(records), (len(responses), len(records))
    return [keyword_letters_reward(response, record_answer(record)) for response, record in zip(responses, records)]


REWARDS: dict[str, Callable[[list[str], list[dict]], list[float]]] = {
    "accuracy": accuracy, "keyword": keyword, "keyword_letters": keyword_letters}
"""Built-in rewards by name (`flexrl.rl.reward_fn`), with the batch signature of a custom reward."""
