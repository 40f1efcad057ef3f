"""Two SP domains of 4 gloo ranks (8 in all): the tiny Qwen2.5-VL under ZeRO-3 + FlexUlysses equals plain HF.

Each domain is a data-parallel replica with its own plan over its own sequences (domain 0: a degree-4
pack; domain 1: degree 2 + degree 1 + degree 1); ZeRO-3 partitions over all 8 ranks; the vision
tower is balanced inside each domain and its embeddings travel over the domain's group
(`GroupTree.domain_group`), which exists also when p_max < domain_size (the p_max=2 case, where no
block spans the domain). Reference: single-process HF (`model.forward`, its own positions and vision
tower) over the sequences of both domains, mean NLL of all response tokens. Checked: every
sequence's response log-probs (assembled from the ranks' local tokens), the summed loss, and every
parameter's full gradient (deepspeed.utils.safe_get_full_grad). Also: which global ranks each
rank's domain group holds, for p_max 1, 2 and 4.
"""

from __future__ import annotations

import pytest
import torch

from grad_checks import worst_relative_grad_diff
from harness import cached_group_tree

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

WORLD, DOMAIN = 8, 4


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from flexrl_ds.models.sample_data import write_scoring_dataset
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("two_domains")
    make_tiny_model(TinyModelConfig(out_dir=str(root / "vl"), seed=11))
    data = write_scoring_dataset(root / "data", num_records=6, seed=4)  # image, video, mixed, text, image, video
    return str(root / "vl"), str(data)


def domain_plans(p_max: int, idle_domain: bool = False) -> list[dict]:
    """Plan JSON of each domain (domain-local ranks 0..3). Domain 0 holds r0, r1, r2; domain 1 r3, r4, r5.
    `idle_domain`: domain 0 holds all six, domain 1 the planner's plan of no sequences."""
    top = 4 if p_max >= 4 else 2
    specs = [
        [(top, 0, ("r2", "r0")), (2, 2, ("r1",))] if top == 2 else [(4, 0, ("r2", "r0", "r1"))],
        [(2, 0, ("r5",)), (1, 2, ("r3",)), (1, 3, ("r4",))],
    ]
    if idle_domain:
        return [_plan_json(specs[0] + specs[1], p_max), _idle_plan_json(p_max)]
    return [_plan_json(spec, p_max) for spec in specs]


def _idle_plan_json(p_max: int) -> dict:
    from flexrl_ds.planning.config import SPConfig
    from flexrl_ds.planning.cost_model import load_cost_model
    from flexrl_ds.planning.plan import Workload
    from flexrl_ds.planning.planner import plan_step

    return plan_step(Workload(()), DOMAIN, load_cost_model("qwen2.5-vl-7b"), SPConfig(p_max=p_max)).plan.to_json()


def _plan_json(spec, p_max: int) -> dict:
    from flexrl_ds.planning.plan import Pack, Plan

    packs = tuple(Pack(i, d, tuple(range(f, f + d)), s) for i, (d, f, s) in enumerate(spec))
    order = {r: tuple(p.id for p in sorted((p for p in packs if r in p.ranks), key=lambda p: (-p.degree, p.id)))
             for r in range(DOMAIN)}
    return Plan(world_size=DOMAIN, p_max=p_max, packs=packs, rank_order=order).to_json()


def _load(model_dir: str):
    from flexrl_ds.models.loading import load_model

    return load_model(model_dir, "float32")


def _samples(model_dir: str, data_path: str) -> dict:
    from flexrl_ds.models.processing import encode_records

    return encode_records(model_dir, data_path)


def rank_domain_groups(p_max_values):
    """On every rank: the global ranks of its domain group, for each p_max."""
    import torch.distributed as dist

    return [list(dist.get_process_group_ranks(cached_group_tree(DOMAIN, p).domain_group)) for p in p_max_values]


def rank_two_domain_step(model_dir: str, data_path: str, plans: list[dict], p_max: int):
    """On every rank: its domain's plan over its domain's sequences, ZeRO-3 forward + backward.
    Returns its local log-probs with their (sequence, positions) pieces; rank 0 also the gradients."""
    import torch.distributed as dist
    from zero3_configs import zero3_config

    from flexrl_ds.models.flex_model import build_step_batch, positions_fn
    from flexrl_ds.models.zero3 import build_engine, data_parallel_size, full_grads, global_token_count
    from flexrl_ds.planning.plan import parse_plan

    torch.manual_seed(0)
    tree = cached_group_tree(DOMAIN, p_max)
    plan = parse_plan(plans[tree.domain])
    mine = {s for pack in plan.packs for s in pack.sequences}
    samples = {s: x for s, x in _samples(model_dir, data_path).items() if s in mine}
    model = _load(model_dir)
    batch = build_step_batch(model.config, plan, samples, tree.local_rank, tree, positions=positions_fn(model))
    engine = build_engine(model, zero3_config(reduce_bucket_size=4096), vision_group=tree.domain_group,
                          logits_chunk=16)
    logprobs, _, zero = engine(batch)
    local_nll = -torch.where(batch.response_mask, logprobs, 0.0).sum()
    num_global = global_token_count(int(batch.response_mask.sum()))  # over both domains (world)
    engine.backward(local_nll * (data_parallel_size(engine) / num_global) + zero)
    grads = full_grads(engine)
    result = {"nll": float(local_nll), "num_global": num_global, "domain": tree.domain,
              "logprobs": logprobs.detach(), "segments": batch.layout.segments(),
              "patches": list(batch.route.patches_per_rank), "paths": list(engine.module.attention.last_paths)}
    if dist.get_rank() == 0:
        result["grads"] = grads
    engine.destroy()
    return result


def _reference(model_dir: str, data_path: str):
    """Single-process HF: response log-probs per sequence and the gradients of the mean NLL."""
    from flexrl_ds.models.flex_model import reference_logprobs

    samples = _samples(model_dir, data_path)
    model = _load(model_dir)
    per_sequence = {s: reference_logprobs(model, x) for s, x in samples.items()}
    num_tokens = sum(lp.numel() for lp in per_sequence.values())
    nll = -sum(lp.sum() for lp in per_sequence.values())
    (nll / num_tokens).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return {s: lp.detach() for s, lp in per_sequence.items()}, float(nll.detach()), num_tokens, grads, samples


def _assemble(per_rank, samples) -> dict:
    """Every sequence's response log-probs from the ranks' local pieces (each position exactly once)."""
    full = {s: torch.full((x.length,), float("nan"), dtype=torch.float64) for s, x in samples.items()}
    for result in per_rank:
        for seq_id, lo, hi, local in result["segments"]:
            assert torch.isnan(full[seq_id][lo:hi]).all(), (seq_id, lo, hi)
            full[seq_id][lo:hi] = result["logprobs"][local:local + hi - lo].double()
    return {s: full[s][x.response_start - 1:x.length - 1] for s, x in samples.items()}


def test_domain_group_is_the_whole_domain_for_every_p_max(dist_pools):
    per_rank = dist_pools(WORLD).run(rank_domain_groups, [1, 2, 4], timeout_s=120)
    for rank, groups in enumerate(per_rank):
        first = rank // DOMAIN * DOMAIN
        assert groups == [list(range(first, first + DOMAIN))] * 3, (rank, groups)


@pytest.mark.parametrize("p_max", [4, 2])
def test_two_domains_zero3_flex_ulysses_match_single_process(assets, dist_pools, p_max):
    model_dir, data_path = assets
    per_rank, worst_lp = _check_against_reference(assets, dist_pools, domain_plans(p_max), p_max)
    for domain in (0, 1):  # vision work spread inside each domain (domain-sized split lists)
        patches = per_rank[domain * DOMAIN]["patches"]
        assert len(patches) == DOMAIN and sum(p > 0 for p in patches) >= 2, (domain, patches)
        assert all(r["patches"] == patches for r in per_rank[domain * DOMAIN:(domain + 1) * DOMAIN])
    paths = {p for r in per_rank for p in r["paths"]}
    assert "local" in paths and paths & {"flex", "flex-async", "deepspeed"}, paths


def test_an_idle_domain_runs_beside_the_other_and_adds_nothing(assets, dist_pools):
    """Domain 1 with the planner's plan of no sequences (a domain short of samples for one of a
    pass's micro-batches, planning/micro_batches.py), domain 0 with all six: the idle ranks run
    every module on a placeholder, so ZeRO-3's gathers and reduce-scatters match, and the
    log-probs, loss and gradients are single-process HF's over the six."""
    per_rank, _ = _check_against_reference(assets, dist_pools, domain_plans(4, idle_domain=True), 4)
    assert all(r["segments"] == [] and r["patches"] == [0] * DOMAIN for r in per_rank[DOMAIN:])
    assert all(r["nll"] == 0.0 for r in per_rank[DOMAIN:])


def _check_against_reference(assets, dist_pools, plans: list[dict], p_max: int):
    """Run the plans on the 8 ranks; check log-probs, loss and gradients against single-process HF.
    Returns the ranks' results and the worst log-prob difference."""
    model_dir, data_path = assets
    ref_logprobs, ref_nll, ref_tokens, ref_grads, samples = _reference(model_dir, data_path)
    per_rank = dist_pools(WORLD).run(rank_two_domain_step, model_dir, data_path, plans, p_max, timeout_s=240)
    assert [r["domain"] for r in per_rank] == [0] * DOMAIN + [1] * DOMAIN
    assert all(r["num_global"] == ref_tokens for r in per_rank)
    got = _assemble(per_rank, samples)
    worst_lp = max(float((got[s] - ref_logprobs[s].double()).abs().max()) for s in samples)
    assert worst_lp < 2e-5, worst_lp
    assert sum(r["nll"] for r in per_rank) == pytest.approx(ref_nll, rel=1e-5)
    worst = worst_relative_grad_diff(per_rank[0]["grads"], ref_grads)
    assert worst < 1e-4, worst
    print(f"p_max={p_max}: max |logprob diff| {worst_lp:.2e}, max relative grad diff {worst:.2e}")
    return per_rank, worst_lp
