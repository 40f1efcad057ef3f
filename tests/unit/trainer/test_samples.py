"""trainer/samples.py: sampling seeds, sample names, mini-batch splits and encoded samples."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from flexrl_ds.loader.metastore import PromptKey, SampleId
from flexrl_ds.runtime.data_controller import prompt_name, sample_name
from flexrl_ds.trainer.samples import (PromptInputs, StepSamples, parse_sample_name, sample_seed, split_domains,
                                      split_mini_batches)

GRID = list(itertools.product((0, 7), (0, 1, 12), (0, 3, 10), (0, 1, 5)))  # (seed, step, slot, k)


def test_sample_seed_is_a_function_of_seed_step_slot_k_only():
    for seed, step, slot, k in GRID:
        first = sample_seed(seed, SampleId(step, slot, k))
        again = sample_seed(seed, SampleId(int(str(step)), int(str(slot)), int(str(k))))  # fresh objects
        assert first == again
        assert 0 <= first < 2**63


def test_sample_seed_differs_across_every_component():
    seeds = {(seed, step, slot, k): sample_seed(seed, SampleId(step, slot, k)) for seed, step, slot, k in GRID}
    assert len(set(seeds.values())) == len(seeds)
    # "s1p23" vs "s12p3": components are separated, not concatenated
    assert sample_seed(0, SampleId(1, 23, 0)) != sample_seed(0, SampleId(12, 3, 0))


def test_parse_sample_name_inverts_sample_name():
    for _, step, slot, k in GRID + [(0, 123, 45, 67)]:
        sample = SampleId(step, slot, k)
        assert parse_sample_name(sample_name(sample)) == sample


def _prompts(num_prompts: int, n: int, step: int = 3) -> list[PromptInputs]:
    prompts = []
    for slot in range(num_prompts):
        key = PromptKey(step, slot)
        names = [sample_name(SampleId(step, slot, k)) for k in range(n)]
        prompts.append(PromptInputs(key, prompt_name(key), None, list(range(slot + 2)), [], names))
    return prompts


def _check_split(prompts, names, num, batches):
    present = set(names)
    groups = [[x for x in p.sample_names if x in present] for p in prompts]
    groups = [g for g in groups if g]
    assert len(batches) == num
    assert [x for batch in batches for x in batch] == [x for g in groups for x in g]  # each once, in order
    counts, position = [], 0
    for batch in batches:  # each batch is a run of whole, consecutive groups
        taken = 0
        while taken < len(batch):
            group = groups[position]
            assert batch[taken:taken + len(group)] == group
            taken, position = taken + len(group), position + 1
        counts.append(sum(1 for g in groups if set(g) <= set(batch)))
    assert max(counts) - min(counts) <= 1
    assert sum(counts) == len(groups)


def test_split_mini_batches_keeps_whole_groups_and_balances():
    rng = random.Random(0)
    for num_prompts, n in itertools.product((1, 2, 3, 5, 8), (1, 2, 4)):
        prompts = _prompts(num_prompts, n)
        all_names = [x for p in prompts for x in p.sample_names]
        kept = [x for x in all_names if rng.random() > 0.2] or all_names[:1]  # some samples missing
        num_groups = len({parse_sample_name(x).slot for x in kept})
        for num in range(1, num_groups + 1):
            _check_split(prompts, kept, num, split_mini_batches(prompts, kept, num))


def test_split_mini_batches_refuses_more_batches_than_prompts():
    prompts = _prompts(3, 2)
    names = [x for p in prompts for x in p.sample_names]
    with pytest.raises(ValueError, match="mini_batches_per_step"):
        split_mini_batches(prompts, names, 4)


def test_step_samples_encoded_is_prompt_then_response():
    prompts = _prompts(3, 2)
    rng = random.Random(1)
    responses = {x: [rng.randrange(100, 200) for _ in range(rng.randint(1, 6))]
                 for p in prompts for x in p.sample_names}
    del responses[prompts[1].sample_names[0]]  # a sample without a response is left out
    samples = StepSamples(prompts, responses)
    expected_names = [x for p in prompts for x in p.sample_names if x in responses]
    assert samples.names == expected_names
    encoded = samples.encoded()
    assert list(encoded) == expected_names
    by_name = {x: p for p in prompts for x in p.sample_names}
    for name, sample in encoded.items():
        prompt = by_name[name]
        assert sample.id == name
        assert sample.input_ids.dtype == torch.long
        assert sample.input_ids.tolist() == prompt.prompt_ids + responses[name]
        assert sample.response_start == len(prompt.prompt_ids)
        assert sample.length == len(prompt.prompt_ids) + len(responses[name])
        assert sample.items is prompt.items
    subset = expected_names[::2]
    assert list(samples.encoded(subset)) == subset


@pytest.mark.parametrize("num_prompts,n,num_domains", [(4, 4, 2), (3, 2, 2), (1, 4, 2), (2, 2, 4), (5, 1, 4)])
def test_split_domains_covers_every_sample_once_and_fills_every_domain(num_prompts, n, num_domains):
    prompts = _prompts(num_prompts, n)
    names = [name for p in prompts for name in p.sample_names]
    weight = {name: float(len(p.prompt_ids)) ** 2 for p in prompts for name in p.sample_names}
    shares = split_domains(prompts, names, num_domains, weight.__getitem__)
    assert len(shares) == num_domains and all(shares)
    assert sorted(x for share in shares for x in share) == sorted(names)
    for share in shares:  # the step's order inside each share
        assert share == [x for x in names if x in set(share)]
    if num_prompts >= num_domains:  # whole prompt groups: a prompt's media stays in one domain
        for p in prompts:
            assert sum(bool(set(p.sample_names) & set(share)) for share in shares) == 1
    loads = [sum(weight[x] for x in share) for share in shares]
    unit = max(weight.values()) * (n if num_prompts >= num_domains else 1)
    assert max(loads) - min(loads) <= unit  # LPT: within one unit


def test_split_domains_with_fewer_samples_than_domains_leaves_the_rest_idle():
    """Prompts set aside can leave fewer samples than domains: one each, the others empty (idle)."""
    prompts = _prompts(1, 2)
    shares = split_domains(prompts, prompts[0].sample_names, 4, lambda name: 1.0)
    assert shares == [[prompts[0].sample_names[0]], [prompts[0].sample_names[1]], [], []]


def test_logprob_gaps_per_sample_overall_and_by_media_match_a_plain_loop():
    from flexrl_ds.models.processing import VisionItem
    from flexrl_ds.trainer.samples import logprob_gaps, media_of

    def item(kind):
        return VisionItem(kind, None, (1, 2, 2), 1.0)

    media = [[], [item("image")], [item("video")], [item("video"), item("image")], [item("image"), item("image")]]
    prompts = _prompts(len(media), n=2)
    for prompt, items in zip(prompts, media):
        prompt.items = items
    rng = random.Random(4)
    names = [name for prompt in prompts for name in prompt.sample_names]
    lengths = {name: rng.randint(1, 6) for name in names}
    engine = {name: [rng.uniform(-5, 0) for _ in range(lengths[name])] for name in names}
    trainer = {name: [rng.uniform(-5, 0) for _ in range(lengths[name])] for name in names}
    samples = StepSamples(prompts, {name: [1] * lengths[name] for name in names}, engine)
    gaps = logprob_gaps(samples, trainer)
    assert [media_of(p) for p in prompts] == ["text", "image", "video", "image+video", "image"]
    kind_of = {name: media_of(p) for p in prompts for name in p.sample_names}
    tokens = [(kind_of[name], abs(e - t)) for name in names for e, t in zip(engine[name], trainer[name])]
    assert gaps.mean == pytest.approx(sum(g for _, g in tokens) / len(tokens))
    for kind in ("text", "image", "video", "image+video"):
        chosen = [g for k, g in tokens if k == kind]
        assert gaps.by_media[kind] == pytest.approx(sum(chosen) / len(chosen))
    assert set(gaps.by_media) == {"text", "image", "video", "image+video"}
    for name in names:
        own = [abs(e - t) for e, t in zip(engine[name], trainer[name])]
        assert gaps.per_sample[name] == pytest.approx(sum(own) / len(own))
