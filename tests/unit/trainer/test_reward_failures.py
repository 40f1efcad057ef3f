"""A step whose reward function failed on every sample stops the run, naming where it raised; a step
where only some failed goes on with those scored 0 (rl/reward_fn.py score_batch is the reference)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flexrl_ds.common import RunInputError
from flexrl_ds.media.types import Record
from flexrl_ds.rl.config import GRPOConfig
from flexrl_ds.trainer.driver import GRPOTrainer


class StandInTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(str(token) for token in row) for row in ids]


def stand_in_trainer(reward_fn) -> GRPOTrainer:
    trainer = GRPOTrainer.__new__(GRPOTrainer)  # only what `_reward` uses
    trainer.encoder = SimpleNamespace(tokenizer=StandInTokenizer())
    trainer.reward_fn = reward_fn
    trainer.o = SimpleNamespace(rl=GRPOConfig(reward_fn="scoring.py:score"))
    return trainer


def step_samples(num_prompts: int = 2, group: int = 2):
    prompts = [SimpleNamespace(record=Record(id=f"p{p}", prompt="say hi", items=(), answer="hi"),
                               sample_names=[f"s{p}k{k}" for k in range(group)]) for p in range(num_prompts)]
    names = [name for prompt in prompts for name in prompt.sample_names]
    return SimpleNamespace(names=names, prompts=prompts, response_ids={n: [1, 2] for n in names},
                           prompt_of=lambda: {n: p for p in prompts for n in p.sample_names})


def failing_on(failing_ids: set[str]):
    def score(responses, records):
        if any(record["id"] in failing_ids for record in records):
            raise KeyError("no column 'difficulty'")
        return [1.0] * len(responses)
    return score


def test_a_step_where_every_sample_failed_stops_naming_where_it_raised():
    with pytest.raises(RunInputError, match=r"'scoring.py:score' failed on all 4 samples of the step, e.g. 's0k0': "
                                           r"KeyError: .*no column 'difficulty'.* \(raised at .*test_reward_failures.py:\d+ "
                                           r"in score\); stopping"):
        stand_in_trainer(failing_on({"p0", "p1"}))._reward(step_samples())


def test_a_step_where_some_samples_failed_goes_on(capsys):
    samples = step_samples()
    info = stand_in_trainer(failing_on({"p1"}))._reward(samples)
    assert info["num_reward_errors"] == 2
    assert samples.rewards == {"s0k0": 1.0, "s0k1": 1.0, "s1k0": 0.0, "s1k1": 0.0}
    assert capsys.readouterr().out.count("failed, scored 0: KeyError") == 2


def test_the_place_named_is_in_the_reward_functions_own_file():
    """An error raised inside a library the reward calls is located at the reward's own line."""
    import json

    def score(responses, records):
        return [json.loads(response) for response in responses]  # "1 2" is no JSON: raises inside json

    own_line = r"raised at .*test_reward_failures.py:\d+ in (score|<listcomp>)\)"  # not json/decoder.py's
    with pytest.raises(RunInputError, match=own_line):
        stand_in_trainer(score)._reward(step_samples())
