"""Under flexrl.sp.max_tokens_per_rank, prompts whose samples could outgrow a sequence's share are
set aside before the rollout, each named with its record and reason; the rest of the step goes on."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from flexrl_ds.common import RunInputError
from flexrl_ds.media.types import Record
from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.trainer.driver import GRPOTrainer
from flexrl_ds.trainer.samples import sequence_token_limit, too_long_prompts

COST = load_cost_model("qwen2.5-vl-7b")  # 28 query heads: the largest power-of-two degree is 16


def prompt(name: str, num_tokens: int):
    return SimpleNamespace(name=name, prompt_ids=[7] * num_tokens, record=Record(id=f"rec-{name}", prompt="q", items=()))


@pytest.mark.parametrize("p_max, domain, largest, bound_by", [(8, 8, 8, "p_max"), (4, 16, 4, "p_max"),
                                                               (32, 32, 16, "num_heads")])
def test_limit_is_the_cap_times_the_largest_degree_the_planner_may_use(p_max, domain, largest, bound_by):
    limit = sequence_token_limit(SPConfig(p_max=p_max, max_tokens_per_rank=100), COST, domain)
    assert (limit.tokens, limit.degree, limit.bound_by) == (100 * largest, largest, bound_by)
    assert sequence_token_limit(SPConfig(p_max=p_max), COST, domain) is None


def test_the_limit_names_the_settings_a_user_can_change():
    by_p_max = sequence_token_limit(SPConfig(p_max=4, max_tokens_per_rank=100), COST, 8).explained(100)
    assert by_p_max == ("flexrl.sp.max_tokens_per_rank 100 x degree 4, the largest that flexrl.sp.p_max allows; "
                        "raise flexrl.sp.max_tokens_per_rank or flexrl.sp.p_max, or lower "
                        "flexrl.rollout.max_response_length")
    by_heads = sequence_token_limit(SPConfig(p_max=32, max_tokens_per_rank=100), COST, 32).explained(100)
    assert "the largest the model's query heads allow; raise flexrl.sp.max_tokens_per_rank, or lower" in by_heads


def test_too_long_counts_the_longest_response():
    prompts = [prompt("s0p0", 700), prompt("s0p1", 701), prompt("s0p2", 10)]
    reasons = too_long_prompts(prompts, max_new_tokens=100, limit=800)
    assert list(reasons) == ["s0p1"]  # 700 + 100 fits exactly; 701 + 100 does not
    assert reasons["s0p1"] == "701 prompt tokens + up to 100 response tokens may exceed the 800 tokens a sequence may hold"


def stand_in_trainer(cap: int | None) -> GRPOTrainer:
    trainer = GRPOTrainer.__new__(GRPOTrainer)  # only what `_fitting` uses
    trainer.o = SimpleNamespace(sp=SPConfig(p_max=4, max_tokens_per_rank=cap), cost=COST, num_ranks=4,
                                sampling=SimpleNamespace(max_new_tokens=100))
    return trainer


def test_a_step_goes_on_without_its_too_long_prompts(capsys):
    prompts = [prompt("s3p0", 300), prompt("s3p1", 301), prompt("s3p2", 5)]
    kept = stand_in_trainer(cap=100)._fitting(3, prompts)  # 100 x degree 4 = 400 tokens a sequence
    assert [p.name for p in kept] == ["s3p0", "s3p2"]
    out = capsys.readouterr().out
    assert ("data: step 3: prompt 's3p1' (record 'rec-s3p1') not rolled out: 301 prompt tokens + up to 100 "
            "response tokens may exceed the 400 tokens a sequence may hold (flexrl.sp.max_tokens_per_rank 100 x "
            "degree 4, the largest that flexrl.sp.p_max allows") in out
    assert "s3p0" not in out and "s3p2" not in out
    assert stand_in_trainer(cap=None)._fitting(3, prompts) == prompts  # no cap: nothing set aside


def test_a_step_with_no_prompt_short_enough_stops():
    with pytest.raises(RunInputError, match=r"step 2: every prompt is too long \(2 prompts, e.g. 50 prompt tokens .*; "
                                           r"flexrl.sp.max_tokens_per_rank 10 x degree 4"):
        stand_in_trainer(cap=10)._fitting(2, [prompt("s2p0", 50), prompt("s2p1", 60)])
