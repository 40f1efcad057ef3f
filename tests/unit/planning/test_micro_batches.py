"""A pass whose sequences together overflow max_tokens_per_rank is cut into the fewest contiguous
micro-batches that plan, every sequence in exactly one, every rank under the cap in each
(planning/micro_batches.py)."""

from __future__ import annotations

import numpy as np
import pytest
from brute_force import tokens_per_rank

from flexrl_ds.planning.config import SPConfig
from flexrl_ds.planning.cost_model import load_cost_model
from flexrl_ds.planning.micro_batches import contiguous_runs, plan_micro_batches
from flexrl_ds.planning.plan import SequenceSpec, Workload
from flexrl_ds.planning.planner import StepOverflowError, plan_step

COST = load_cost_model("qwen2.5-vl-7b")


def workload(lengths, prefix="s") -> Workload:
    return Workload(tuple(SequenceSpec(id=f"{prefix}{i}", tokens=int(n)) for i, n in enumerate(lengths)))


@pytest.mark.parametrize("seed", range(20))
def test_runs_cover_every_sequence_once_in_order_with_balanced_totals(seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 1000, size=int(rng.integers(1, 40))).tolist()
    for num in range(1, len(tokens) + 1):
        runs = contiguous_runs(tokens, num)
        assert [i for run in runs for i in run] == list(range(len(tokens)))
        assert len(runs) == num and all(len(run) > 0 for run in runs)
        if num * max(tokens) <= sum(tokens):  # room to balance: no run is more than a sequence over the mean
            assert max(sum(tokens[i] for i in run) for run in runs) <= sum(tokens) / num + max(tokens)


def test_more_runs_than_sequences_is_refused():
    with pytest.raises(ValueError, match="cannot cut 2 sequences into 3"):
        contiguous_runs([5, 5], 3)


def test_without_a_cap_a_pass_is_one_micro_batch_and_the_plain_plan():
    share = workload([4000, 3000, 900, 800, 120])
    (only,), = plan_micro_batches([share], 8, COST, SPConfig(p_max=8))
    assert only.plan.to_json() == plan_step(share, 8, COST, SPConfig(p_max=8)).plan.to_json()


def plans(sequences, sp, world_size=8) -> bool:
    try:
        plan_step(Workload(tuple(sequences)), world_size, COST, sp)
    except StepOverflowError:
        return False
    return True


@pytest.mark.parametrize("seed", range(6))
def test_an_overflowing_pass_is_cut_into_the_fewest_contiguous_micro_batches_that_fit(seed):
    rng = np.random.default_rng(seed)
    sp = SPConfig(p_max=4, max_tokens_per_rank=2000)
    shares = [workload(rng.integers(200, 8000, size=int(rng.integers(6, 14))), prefix=f"d{d}s") for d in range(2)]
    assert not all(plans(share.sequences, sp) for share in shares)  # as one pass, a domain overflows
    micro_batches = plan_micro_batches(shares, 8, COST, sp)
    assert all(len(results) == 2 for results in micro_batches)  # every micro-batch runs on both domains
    runs_per_domain = []
    for domain, share in enumerate(shares):
        runs = [[x for p in results[domain].plan.packs for x in p.sequences] for results in micro_batches]
        order = {s.id: i for i, s in enumerate(share.sequences)}
        runs = [sorted(run, key=order.get) for run in runs]
        assert [x for run in runs for x in run] == [s.id for s in share.sequences]  # contiguous, every one once
        for results in micro_batches:
            assert tokens_per_rank(results[domain].plan, share).max() <= sp.max_tokens_per_rank + 1e-9
        runs_per_domain.append(runs)
    # the fewest: an exhaustive search over contiguous cuts (each run checked with plan_step) needs as many
    assert len(micro_batches) == max(fewest_contiguous_runs(share.sequences, sp) for share in shares)


def fewest_contiguous_runs(sequences, sp) -> int:
    """Reference: the fewest runs of consecutive sequences that each plan, by dynamic programming
    over every cut (no assumption that a part of a run that plans plans too)."""
    fewest = [0] + [len(sequences) + 1] * len(sequences)  # fewest[i]: runs covering the first i
    for stop in range(1, len(sequences) + 1):
        for start in range(stop):
            if fewest[start] + 1 < fewest[stop] and plans(sequences[start:stop], sp):
                fewest[stop] = fewest[start] + 1
    return fewest[-1]


def test_micro_batches_are_balanced_where_balanced_runs_plan():
    """Ten equal sequences, room for three per pass: greedy needs four runs (3, 3, 3, 1); the four
    micro-batches then hold 2 or 3 sequences each, not a lone last one."""
    sp = SPConfig(p_max=4, max_tokens_per_rank=800)  # 3,200 tokens a pass on 4 ranks
    micro_batches = plan_micro_batches([workload([1000] * 10)], 4, COST, sp)
    sizes = [sum(len(p.sequences) for p in results[0].plan.packs) for results in micro_batches]
    assert len(sizes) == 4 and sum(sizes) == 10 and set(sizes) <= {2, 3}


def test_a_domain_with_fewer_runs_splits_its_largest_to_match():
    sp = SPConfig(p_max=4, max_tokens_per_rank=1000)
    shares = [workload([3900] * 3, prefix="a"), workload([100, 100, 2000, 100], prefix="b")]  # 'a': 3 runs, 'b': 1
    micro_batches = plan_micro_batches(shares, 4, COST, sp)
    assert len(micro_batches) == 3
    b_runs = [[x for p in results[1].plan.packs for x in p.sequences] for results in micro_batches]
    assert all(b_runs) and sorted(x for run in b_runs for x in run) == ["b0", "b1", "b2", "b3"]


def test_a_domain_with_fewer_sequences_than_micro_batches_idles_in_the_rest():
    """'a' needs 6 passes, 'b' has 2 sequences: 'b' runs one in each of two micro-batches and an
    empty plan (no packs, every rank idle) in the other four."""
    sp = SPConfig(p_max=4, max_tokens_per_rank=1000)
    shares = [workload([3900] * 6, prefix="a"), workload([300, 200], prefix="b")]
    micro_batches = plan_micro_batches(shares, 4, COST, sp)
    assert len(micro_batches) == 6
    a_runs = [[x for p in results[0].plan.packs for x in p.sequences] for results in micro_batches]
    b_runs = [[x for p in results[1].plan.packs for x in p.sequences] for results in micro_batches]
    assert a_runs == [[f"a{i}"] for i in range(6)]
    assert b_runs == [["b0"], ["b1"], [], [], [], []]  # the idle micro-batches last, as the driver says
    for results in micro_batches:
        idle = results[1]
        if not idle.plan.packs:
            assert idle.plan.rank_order == {rank: () for rank in range(4)} and idle.metrics.num_packs == 0
    # a domain with no sequence at all idles in every micro-batch
    micro_batches = plan_micro_batches([workload([3900] * 3), Workload(())], 4, COST, sp)
    assert len(micro_batches) == 3 and all(results[1].plan.packs == () for results in micro_batches)
    assert all(results[1].metrics.degree_histogram == {} for results in micro_batches)


def test_an_empty_workload_plans_as_every_rank_idle():
    result = plan_step(Workload(()), 4, COST, SPConfig(p_max=4))
    assert result.plan.packs == () and result.plan.to_json()["rank_order"] == {str(r): [] for r in range(4)}
    assert result.plan.extra["degree_cap"]["max_degree"] == 4 and result.metrics.efficiency == 1.0
