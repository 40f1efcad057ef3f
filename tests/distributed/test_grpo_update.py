"""One GRPO optimizer step on 4 gloo ranks (ZeRO-3 from a JSON dict, FlexUlysses with degrees 1, 2 and 4)
equals the same step computed by plain single-process HF.

Fixed rollouts: the tiny random Qwen2.5-VL, records with images and a video, each prompt twice (two
GRPO samples sharing its media) with random response tokens; old-policy and reference log-probs are
the model's own plus noise (so ratios leave the clip range), advantages random per sample.
Reference: `model.forward` with HF positions per sample, the GRPO loss as a plain loop over tokens,
`torch.nn.utils.clip_grad_norm_` and `torch.optim.AdamW` with the JSON's hyper-parameters. Checked:
the loss, the global gradient norm before clipping, and every parameter after the step.

The "idle" plan puts a 2-token sequence alone in a degree-4 pack, so ranks 2 and 3 hold no token at
all but must still join that pack's all-to-alls (before, they skipped them and ranks 0-1 hung).

Also: ZeRO-3 states moved to host memory and back between two steps, as around a colocated rollout
(`zero3.RolloutOffload`), train exactly as states that stayed in place.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from harness import cached_group_tree

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]
FIRST_CPU_ADAM_BUILD = pytest.mark.timeout(600)
"""A case that may JIT-build DeepSpeed's CPUAdam first on a clean machine: 35-55 s, 160 s on a loaded 2-core one."""

WORLD = 4
LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-2, (0.9, 0.95), 1e-4, 0.01, 0.5
RL = dict(eps_clip_low=0.2, eps_clip_high=0.28, dual_clip=1.1,  # 1.1: the dual clip caps some tokens
          init_kl_coef=0.05, kl_estimator="k3",
          entropy_coef=0.01)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from flexrl_ds.models.sample_data import write_scoring_dataset
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("grpo_update")
    make_tiny_model(TinyModelConfig(out_dir=str(root / "vl"), seed=7))
    data = write_scoring_dataset(root / "data", num_records=4, seed=5)  # image, video, image+video, text
    return str(root / "vl"), str(data)


def rollouts(model_dir: str, data_path: str, with_tiny: bool) -> dict:
    """Every prompt twice with random response tokens (same on every process); `with_tiny` adds a
    2-token text sequence (one prompt token, one response token)."""
    from flexrl_ds.models.processing import EncodedSample, encode_records

    gen = torch.Generator().manual_seed(3)
    out = {}
    for seq_id, sample in encode_records(model_dir, data_path).items():
        prompt = sample.input_ids[:sample.response_start]
        items = [dataclasses.replace(item, share_key=f"{seq_id}/{k}") for k, item in enumerate(sample.items)]
        for copy in ("a", "b"):
            response = torch.randint(0, 500, (int(torch.randint(2, 12, (1,), generator=gen)),), generator=gen)
            out[f"{seq_id}-{copy}"] = EncodedSample(f"{seq_id}-{copy}", torch.cat([prompt, response]),
                                                    sample.response_start, items)
    if with_tiny:
        out["tiny"] = EncodedSample("tiny", torch.tensor([17, 42]), 1, [])
    return out


def make_plan(ids: list[str], kind: str):
    """mixed: degrees 4, 2, 2 and 1 on every rank. idle: 'tiny' alone at degree 4, all else on ranks 0-1."""
    ids = sorted(i for i in ids if i != "tiny")
    if kind == "mixed":
        specs = [(4, 0, ids[0:2]), (2, 0, ids[2:4]), (2, 2, ids[4:6])] + [(1, r, ids[6 + r::4]) for r in range(4)]
    else:
        specs = [(4, 0, ["tiny"]), (2, 0, ids[0:4]), (1, 0, ids[4::2]), (1, 1, ids[5::2])]
    return _plan_of(specs)


def make_micro_plans(ids: list[str]):
    """A mini-batch cut into two micro-batches: the first half of the samples in one degree-4 pack,
    the rest in degree-2 and degree-1 packs."""
    ids = sorted(ids)
    half = len(ids) // 2
    return [_plan_of([(4, 0, ids[:half])]),
            _plan_of([(2, 0, ids[half:half + 2]), (1, 2, ids[half + 2::2]), (1, 3, ids[half + 3::2])])]


def _plan_of(specs: list[tuple[int, int, list[str]]]):
    """A plan of packs (degree, first rank, sequences), ranks in HSF order."""
    from flexrl_ds.planning.plan import Pack, Plan

    packs = tuple(Pack(i, d, tuple(range(f, f + d)), tuple(s)) for i, (d, f, s) in enumerate(specs) if s)
    order = {r: tuple(p.id for p in sorted((p for p in packs if r in p.ranks), key=lambda p: (-p.degree, p.id)))
             for r in range(WORLD)}
    return Plan(world_size=WORLD, p_max=4, packs=packs, rank_order=order)


def _load(model_dir: str):
    from flexrl_ds.models.loading import load_model

    return load_model(model_dir).train()


def fixed_values(model_dir: str, samples: dict) -> dict:
    """Old / reference log-probs per response token (the model's own plus noise) and advantages."""
    from flexrl_ds.models.flex_model import reference_logprobs

    model = _load(model_dir)
    gen = torch.Generator().manual_seed(11)
    values = {"old": {}, "ref": {}, "adv": {}}
    with torch.no_grad():
        for seq_id, sample in samples.items():
            own = reference_logprobs(model, sample)
            values["old"][seq_id] = (own + 0.3 * torch.randn(own.shape, generator=gen)).tolist()
            values["ref"][seq_id] = (own + 0.2 * torch.randn(own.shape, generator=gen)).tolist()
            values["adv"][seq_id] = float(torch.randn((), generator=gen))
    return values


def rank_grpo_step(model_dir: str, data_path: str, plan_json: dict | list[dict], values: dict, rl: dict,
                   offload: str = "none", checkpointing: bool = False):
    """On every rank: ZeRO-3 engine from JSON, one GRPO train_step (over the micro-batches of a list
    of plans); rank 0 returns the parameters."""
    from flexrl_ds.models import policy_update as pu

    engine, batches, step = _rank_engine(model_dir, data_path, plan_json, values, rl, offload, checkpointing)
    runs = _count_layer_runs(engine.module.hf_model)
    result = step()
    out = {"metrics": pu.reduce_stats(result.stats), "grad_norm": result.grad_norm,
           "num_local": sum(b.layout.num_local_tokens for b in batches),
           "num_packs": sum(len(b.layout.packs) for b in batches), "layer_runs": runs, **_rank0_params(engine)}
    engine.destroy()
    return out


def _rank_engine(model_dir: str, data_path: str, plan_json: dict | list[dict], values: dict, rl: dict,
                 offload: str, checkpointing: bool = False):
    """This rank's ZeRO-3 engine (the JSON from zero3_configs with the test's hyper-parameters), its
    StepBatch of each plan (one per micro-batch), and a function running one GRPO train_step on them
    (`rl`: GRPOConfig's fields)."""
    from zero3_configs import zero3_config

    from flexrl_ds.models import policy_update as pu
    from flexrl_ds.models.flex_model import build_step_batch, place_rank, positions_fn
    from flexrl_ds.models.loading import load_model
    from flexrl_ds.models.zero3 import build_engine
    from flexrl_ds.planning.plan import parse_plan
    from flexrl_ds.rl.config import GRPOConfig

    torch.manual_seed(0)
    plans = [parse_plan(p) for p in (plan_json if isinstance(plan_json, list) else [plan_json])]
    tree = cached_group_tree(WORLD, plans[0].p_max)
    samples = rollouts(model_dir, data_path, with_tiny=any("tiny" in p.sequences for plan in plans for p in plan.packs))
    model = load_model(model_dir)  # in eval mode, as the policy worker loads it: the engine must switch
    batches = []
    for plan in plans:  # each micro-batch over its own samples, as the policy worker builds them
        own = {s: samples[s] for pack in plan.packs for s in pack.sequences}
        placement = place_rank(model.config, plan, own, tree.local_rank, tree)
        batches.append(build_step_batch(model.config, plan, own, tree.local_rank, positions=positions_fn(model),
                                        placement=placement))
    engine = build_engine(model, zero3_config(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                              gradient_clipping=CLIP, reduce_bucket_size=4096,
                                              offload_optimizer=offload), logits_chunk=8,
                         activation_checkpointing=checkpointing)
    config = GRPOConfig(**rl)
    denoms = pu.denominators({s: x.length - x.response_start for s, x in samples.items()})  # the whole mini-batch

    def step():
        values_on = pu.local_response_values
        return pu.train_step(engine, [pu.UpdateInputs(b, values_on(b, values["old"]), values_on(b, values["ref"]),
                                                      values_on(b, values["adv"])) for b in batches], config, denoms)
    return engine, batches, step


def _rank0_params(engine) -> dict:
    """{"params": every parameter, gathered} on rank 0; {} elsewhere (the gather is collective)."""
    import deepspeed
    import torch.distributed as dist

    params = dict(engine.module.hf_model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        if dist.get_rank() == 0:
            return {"params": {name: p.detach().clone() for name, p in params.items()}}
    return {}


def _count_layer_runs(hf_model) -> dict[str, dict[str, int]]:
    """Runs of the first decoder layer and the first vision block, in the forward pass and (recomputed)
    inside the backward pass, counted by a pre-hook on a module inside each (the recompute stops
    early, once the saved tensors are back, so a hook after the layer's end may never fire)."""
    runs = {"decoder": {"forward": 0, "backward": 0}, "vision": {"forward": 0, "backward": 0}}
    layers = {"decoder": "DecoderLayer", "vision": "VisionBlock"}
    for kind, suffix in layers.items():
        layer = next(m for m in hf_model.modules() if type(m).__name__.endswith(suffix))

        def count(*_, kind=kind):
            runs[kind]["backward" if torch._C._current_graph_task_id() != -1 else "forward"] += 1
        layer.mlp.register_forward_pre_hook(count)
    return runs


def reference_step(model_dir: str, samples: dict, values: dict, rl: dict, micro_batches: list[list[str]] | None = None):
    """Plain HF + a loop over tokens + torch clip/AdamW: (loss, grad norm, parameters after the step,
    entropy reduced as the loss is, the share of tokens the dual clip capped, the MoE's auxiliary loss:
    transformers' over all samples' router rows, or the mean of its value over each of `micro_batches`'
    samples)."""
    model = _load(model_dir)
    c = rl
    per_sequence, entropies, dual_clipped, routers = [], [], [], []
    moe = getattr(model.config.get_text_config(), "num_experts", None) is not None
    for seq_id, sample in samples.items():
        output = model(**_inputs(model, sample), **({"output_router_logits": True} if moe else {}))
        logits = output.logits[0].float()
        routers.append(output.router_logits if moe else None)
        logp_all = torch.log_softmax(logits[:-1], dim=-1)[sample.response_start - 1:]
        targets = sample.input_ids[sample.response_start:]
        terms, entropy_terms = [], []
        for t in range(targets.shape[0]):
            lp = logp_all[t, targets[t]]
            entropy = -(logp_all[t].exp() * logp_all[t]).sum()
            ratio = torch.exp(lp - values["old"][seq_id][t])
            adv = values["adv"][seq_id]
            pg = -torch.min(ratio * adv, ratio.clamp(1 - c["eps_clip_low"], 1 + c["eps_clip_high"]) * adv)
            if adv < 0:
                dual_clipped.append(float(pg.detach()) > -c["dual_clip"] * adv)
                pg = torch.clamp(pg, max=-c["dual_clip"] * adv)
            log_ratio = lp - values["ref"][seq_id][t]
            kl = (torch.exp(-log_ratio) - 1 + log_ratio).clamp(-10.0, 10.0)
            terms.append(pg + c["init_kl_coef"] * kl - c["entropy_coef"] * entropy)
            entropy_terms.append(float(entropy.detach()))
        per_sequence.append(terms)
        entropies.append(entropy_terms)

    def reduce(per_token: list) -> float:
        if c["loss_reduction"] == "token_mean":
            return sum(t for terms in per_token for t in terms) / sum(len(terms) for terms in per_token)
        return sum(sum(terms) / len(terms) for terms in per_token) / len(per_token)
    loss = reduce(per_sequence)
    aux = None
    if moe:  # transformers' auxiliary loss over every sample's router rows, layer by layer
        from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

        text = model.config.get_text_config()
        by_id = dict(zip(samples, routers))
        groups = [[by_id[i] for i in ids] for ids in micro_batches] if micro_batches else [routers]
        aux = sum(load_balancing_loss_func(tuple(torch.cat([r[layer] for r in group]) for layer in range(len(group[0]))),
                                           text.num_experts, text.num_experts_per_tok) for group in groups) / len(groups)
        loss = loss + c.get("router_aux_loss_coef", 0.0) * aux
    loss.backward()
    params = [p for p in model.parameters()]
    norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in params if p.grad is not None))
    torch.nn.utils.clip_grad_norm_(params, CLIP)
    torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY).step()
    num_tokens = sum(len(terms) for terms in per_sequence)
    return (float(loss.detach()), norm, {name: p.detach() for name, p in model.named_parameters()}, reduce(entropies),
            sum(dual_clipped) / num_tokens, None if aux is None else float(aux.detach()))


def _inputs(model, sample):
    from flexrl_ds.models.flex_model import reference_inputs

    return reference_inputs(model, sample)


@pytest.mark.parametrize("kind,reduction,offload,checkpointing", [
    ("mixed", "token_mean", "none", False), ("idle", "sequence_mean", "none", False),
    ("mixed", "token_mean", "torch_adam", False), pytest.param("mixed", "token_mean", "cpu_adam_ratio", False,
                                                               marks=FIRST_CPU_ADAM_BUILD),
    ("mixed", "token_mean", "none", True), ("idle", "sequence_mean", "none", True),
    ("micro", "token_mean", "none", False), ("micro", "sequence_mean", "torch_adam", False)])
def test_grpo_step_on_zero3_flex_ulysses_equals_plain_hf(assets, dist_pools, kind, reduction, offload, checkpointing):
    """offload: the optimizer offloaded to host memory, all of it under torch's AdamW, or half of it
    under DeepSpeed's CPUAdam (the 7B GPU run's set-up, `offload_optimizer.ratio`). CPUAdam's
    vectorised arithmetic is not torch's: its parameters are compared to 1% of one step. The idle
    plans run without the entropy bonus: the entropy is then only logged, and must still be right.
    checkpointing: every decoder and vision layer recomputed in backward (its all-to-alls, and on
    the idle plan the empty ranks' placeholder, run again). micro: the mini-batch cut into two
    micro-batches whose gradients accumulate into the one optimizer step (as the trainer runs a
    mini-batch over flexrl.sp.max_tokens_per_rank): still the single-pass reference's step."""
    check_grpo_step(assets, dist_pools, kind, reduction, offload, checkpointing)


@pytest.fixture(scope="module")
def qwen3_assets(tmp_path_factory):
    from flexrl_ds.models.sample_data import write_scoring_dataset
    from flexrl_ds.models.tiny import TinyModelConfig, make_tiny_model

    root = tmp_path_factory.mktemp("grpo_update_qwen3")
    data = write_scoring_dataset(root / "data", num_records=4, seed=5)  # image, video (2-3 frame groups), both, text
    return {arch: (str(make_tiny_model(TinyModelConfig(out_dir=str(root / arch), arch=arch, seed=7))), str(data))
            for arch in ("qwen3-vl", "qwen3-vl-moe")}


@pytest.mark.parametrize("arch,kind,checkpointing,aux_coef", [
    ("qwen3-vl", "mixed", False, 0.0), ("qwen3-vl", "mixed", True, 0.0), ("qwen3-vl-moe", "mixed", False, 0.0),
    ("qwen3-vl-moe", "mixed", False, 0.5), ("qwen3-vl-moe", "micro", False, 0.5)])
def test_grpo_step_of_qwen3_vl_equals_plain_hf(qwen3_assets, dist_pools, arch, kind, checkpointing, aux_coef):
    """The same step for tiny Qwen3-VL (DeepStack rows through the vision exchange) and its MoE (sparse
    blocks as ZeRO-3 leaf modules), degrees 1, 2 and 4. The MoE's router auxiliary loss is reported
    as transformers computes it over all samples' router rows, and with aux_coef > 0 is in the loss;
    over two micro-batches, the mean of each one's."""
    check_grpo_step(qwen3_assets[arch], dist_pools, kind, "token_mean", "none", checkpointing, aux_coef)


def check_grpo_step(assets, dist_pools, kind, reduction, offload, checkpointing, aux_coef=0.0):
    """The 4-rank ZeRO-3 step equals the plain-HF step (the test above)."""
    if offload == "cpu_adam_ratio":
        _build_cpu_adam()
    model_dir, data_path = assets
    samples = rollouts(model_dir, data_path, with_tiny=kind == "idle")
    plans = make_micro_plans(list(samples)) if kind == "micro" else [make_plan(list(samples), kind)]
    values = fixed_values(model_dir, samples)
    rl = {**RL, "loss_reduction": reduction, "entropy_coef": 0.0 if kind == "idle" else RL["entropy_coef"]}
    if aux_coef:
        rl["router_aux_loss_coef"] = aux_coef
    per_rank = dist_pools(WORLD).run(rank_grpo_step, model_dir, data_path, [p.to_json() for p in plans], values, rl,
                                     offload, checkpointing, timeout_s=240)
    micro_ids = [sorted({seq for pack in plan.packs for seq in pack.sequences}) for plan in plans] \
        if len(plans) > 1 else None
    ref_loss, ref_norm, ref_params, ref_entropy, ref_dual_clip_frac, ref_aux = reference_step(model_dir, samples,
                                                                                              values, rl, micro_ids)
    if kind == "idle":  # ranks 2, 3: no token, but a member of the degree-4 pack
        assert [(r["num_local"] == 0, r["num_packs"]) for r in per_rank][2:] == [(True, 1), (True, 1)]
    for r in per_rank:  # with checkpointing each layer that ran forward runs again in backward
        assert r["layer_runs"]["decoder"] == {"forward": len(plans), "backward": len(plans) * checkpointing}
        vision = r["layer_runs"]["vision"]
        assert vision["backward"] == (vision["forward"] if checkpointing else 0)
    assert any(r["layer_runs"]["vision"]["forward"] for r in per_rank)
    metrics = per_rank[0]["metrics"]
    assert all(r["metrics"] == metrics for r in per_rank)
    assert metrics["num_tokens"] == sum(x.length - x.response_start for x in samples.values())
    assert metrics["loss"] == pytest.approx(ref_loss, rel=1e-5, abs=1e-6)
    assert metrics.get("router_aux_loss") == (None if ref_aux is None else pytest.approx(ref_aux, rel=1e-5))
    assert metrics["entropy"] == pytest.approx(ref_entropy, rel=1e-5) and ref_entropy > 0
    assert metrics["dual_clip_frac"] == pytest.approx(ref_dual_clip_frac, rel=1e-6) and ref_dual_clip_frac > 0
    assert 0 < metrics["clip_frac"] < 1
    norms = [r["grad_norm"] for r in per_rank]
    assert norms == [norms[0]] * WORLD and norms[0] > CLIP  # clipping is active
    assert norms[0] == pytest.approx(ref_norm, rel=1e-5)
    params = per_rank[0]["params"]
    assert set(params) == set(ref_params)
    before = dict(_load(model_dir).named_parameters())
    assert max(float((ref_params[n] - before[n].detach()).abs().max()) for n in ref_params) > LR / 2  # the step moved
    atol = LR / 100 if offload == "cpu_adam_ratio" else 2e-6
    for name, expected in ref_params.items():
        torch.testing.assert_close(params[name], expected, atol=atol, rtol=1e-5, msg=name)


def _build_cpu_adam() -> None:
    """JIT-build DeepSpeed's CPUAdam once in this process (the ranks then load the cached build);
    skipped where there is no C++ toolchain."""
    import shutil

    if not (shutil.which("g++") and shutil.which("ninja")):
        pytest.skip("DeepSpeed's CPUAdam needs g++ and ninja to build")
    from deepspeed.ops.op_builder import CPUAdamBuilder

    CPUAdamBuilder().load()


def rank_steps_around_rollout_offload(model_dir: str, data_path: str, plan_json: dict, values: dict, offload: str,
                                      move_states: bool):
    """On every rank: two GRPO steps on one engine; with `move_states`, its ZeRO-3 states go to host
    memory and back between them (`zero3.RolloutOffload`, as around a colocated rollout). Returns what
    moved, DeepSpeed's refusal, and (rank 0) the parameters after the second step."""
    from flexrl_ds.models.zero3 import RolloutOffload

    engine, _, step = _rank_engine(model_dir, data_path, plan_json, values, {**RL, "loss_reduction": "token_mean"},
                                   offload)
    moved, states = (), RolloutOffload(engine)
    step()
    if move_states:
        moved = states.offload()
        states.reload()
        assert states.offloaded() == ()
    step()
    out = {"moved": moved, "refusal": states.refusal, **_rank0_params(engine)}
    engine.destroy()
    return out


@pytest.mark.parametrize("offload", ["none", pytest.param("cpu_adam_ratio", marks=FIRST_CPU_ADAM_BUILD)])
def test_states_moved_for_a_rollout_and_back_train_as_if_never_moved(assets, dist_pools, offload):
    """offload none: torch's AdamW on the device, whose fp32 states DeepSpeed refuses to move, so the
    parameters and gradients move alone; cpu_adam_ratio: DeepSpeed picks what moves itself. Either way
    the second step's parameters equal those of an engine that kept its states in place."""
    from flexrl_ds.models.zero3 import STATES_ANY_OPTIMIZER

    if offload == "cpu_adam_ratio":
        _build_cpu_adam()
    model_dir, data_path = assets
    samples = rollouts(model_dir, data_path, with_tiny=False)
    plan = make_plan(list(samples), "mixed")
    values = fixed_values(model_dir, samples)
    runs = {move: dist_pools(WORLD).run(rank_steps_around_rollout_offload, model_dir, data_path, plan.to_json(),
                                        values, offload, move, timeout_s=240) for move in (False, True)}
    moved = runs[True][0]["moved"]
    assert "lp_params" in moved and all(r["moved"] == moved for r in runs[True])
    assert not {"optim_states", "hp_params"} & set(moved)
    if offload == "none":
        assert set(moved) == set(STATES_ANY_OPTIMIZER)
        assert "FusedAdam" in runs[True][0]["refusal"]
    else:
        assert runs[True][0]["refusal"] == "" and "lp_grads" not in moved  # DeepSpeed leaves them out itself
    kept, moved_params = runs[False][0]["params"], runs[True][0]["params"]
    assert set(kept) == set(moved_params)
    for name, expected in kept.items():
        torch.testing.assert_close(moved_params[name], expected, atol=0, rtol=0, msg=name)
