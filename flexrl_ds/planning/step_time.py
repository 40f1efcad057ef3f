"""Calibrated step-time model of a FlexUlysses step: what the planner minimises. Pure (numpy only).

One decoder layer, forward + backward, measured on the real hardware (`flexrl bench sp --calibrate`):

- attention of one pack (one varlen call) holding `h` of the model's `H` query heads:
  `(h/H)·(a·Σ L² + b·Σ L) + c` seconds — `c` is a per-call floor (kernel launches, the small-pack
  regime where a Ulysses SP=2 layer on 512–1K tokens runs at 0.47× one GPU); a rank's consecutive
  degree-1 packs run as one call (sp/layout.py `attention_units`), so they pay one `c` together;
- linear layers (projections + MLP) on the rank's `T` local tokens, all packs in one forward:
  `s·T + c_linear`;
- one pack's all-to-alls on `d` ranks: forward q/k/v (merged) and output, backward the same, so 4
  collectives of `latency(d)` plus `bytes/bandwidth(d)`, where a rank sends `(d−1)/d` of its
  `T/d` tokens' `(2·H + 2·KV_held)·head_dim` elements (KV_held: KV heads summed over the group,
  replicated ones counted; planning/heads.py), ×2 for the backward. Inside a node the link is the
  measured (or assumed) NVLink figure for the group size; a group spanning nodes sends
  `(d−g)/(d−1)` of it over the network (g GPUs per node), in parallel with the rest over NVLink.

All per-layer times × `num_layers`. With overlap, a pack's all-to-all runs under the previous
pack's attention on the same rank (the executor issues pack j+1's exchange before pack j's
attention), so only `max(0, comm_j − attention_{j−1})` is exposed. A rank's time is linear +
attention + exposed all-to-all; the step's is the busiest rank's, and the others wait (idle).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

import numpy as np

from flexrl_ds.planning.heads import heads_per_rank, kv_heads_held


@dataclass(frozen=True)
class Link:
    """Latency and bandwidth of one all-to-all (bytes leaving each rank per second)."""

    latency_s: float
    """Seconds of a tiny all-to-all."""
    bytes_per_s: float
    """Bytes leaving each rank per second for a large one."""
    measured: bool = True
    """False where the figure is assumed, not measured."""


@dataclass(frozen=True)
class StepTimeModel:
    """Calibrated per-layer times (see the module docstring)."""

    attention_fit: tuple[float, float, float]
    """(a, b, c): one layer's attention of a pack with all heads, fwd+bwd: a·ΣL² + b·ΣL + c seconds."""
    linear_fit: tuple[float, float]
    """(s, c_linear): one layer's linear work on T local tokens, fwd+bwd: s·T + c_linear seconds."""
    num_layers: int
    """Decoder layers the per-layer times are multiplied by."""
    links: dict[int, Link] = field(default_factory=dict)
    """Group size (inside one node) -> all-to-all link; sizes not listed use the nearest smaller one."""
    gpus_per_node: int = 8
    """GPUs sharing NVLink; larger groups cross the network."""
    network: Link | None = None
    """Per-GPU network link across nodes (None: groups never span nodes)."""
    bytes_per_element: int = 2
    """Bytes of one activation element (bf16: 2)."""

    def link(self, degree: int) -> Link:
        inside = min(degree, self.gpus_per_node)
        known = sorted(d for d in self.links if d <= inside) or sorted(self.links)
        if not known:
            return Link(0.0, float("inf"), measured=False)
        exact = self.links[known[-1]]
        return exact if known[-1] == inside else Link(exact.latency_s, exact.bytes_per_s, measured=False)

    def attention_s(self, sum_l2, sum_l, share, packs=1):
        """Seconds of attention (all layers) for packs holding Σ L², Σ L at a head share."""
        a, b, c = self.attention_fit
        return self.num_layers * (share * (a * sum_l2 + b * sum_l) + c * packs)

    def linear_s(self, tokens):
        """Seconds of the linear layers (all layers) on a rank holding `tokens` local tokens."""
        s, c = self.linear_fit
        return self.num_layers * (s * tokens + c)

    def all_to_all_s(self, pack_tokens, degree: int, num_heads: int, num_kv_heads: int, head_dim: int):
        """Seconds (all layers, fwd+bwd) of one pack's all-to-alls on one rank of its group."""
        if degree <= 1:
            return 0.0 * np.asarray(pack_tokens, dtype=float)
        heads = 2 * num_heads + 2 * kv_heads_held(num_heads, num_kv_heads, degree)
        sent = 2 * np.asarray(pack_tokens, dtype=float) / degree * (degree - 1) / degree
        sent = sent * heads * head_dim * self.bytes_per_element
        local = self.link(degree)
        if degree <= self.gpus_per_node or self.network is None:
            return self.num_layers * (4 * local.latency_s + sent / local.bytes_per_s)
        remote = (degree - self.gpus_per_node) / (degree - 1)
        seconds = np.maximum(sent * (1 - remote) / local.bytes_per_s, sent * remote / self.network.bytes_per_s)
        return self.num_layers * (4 * max(local.latency_s, self.network.latency_s) + seconds)


@dataclass(frozen=True)
class LinkOverrides:
    """Replacement all-to-all figures for a projection to another machine (`flexrl simulate`);
    None keeps the calibration's. Replaced figures count as assumed."""

    gpus_per_node: int | None = None
    """GPUs sharing NVLink; aligned groups larger than this span nodes."""
    nvlink_bytes_per_s: float | None = None
    """Bytes per second leaving each GPU inside a node, for every group size."""
    network_bytes_per_s: float | None = None
    """Bytes per second leaving each GPU across nodes (its NIC)."""
    network_latency_s: float | None = None
    """Seconds of a tiny all-to-all across nodes."""

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nvlink_bytes_per_s", "network_bytes_per_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name}: must be positive, got {value}")
        if self.network_latency_s is not None and self.network_latency_s < 0:
            raise ValueError(f"network_latency_s: must be >= 0, got {self.network_latency_s}")

    def apply(self, model: StepTimeModel) -> StepTimeModel:
        links = model.links
        if self.nvlink_bytes_per_s is not None:
            links = {d: Link(link.latency_s, self.nvlink_bytes_per_s, measured=False) for d, link in links.items()}
        network = model.network
        if self.network_bytes_per_s is not None or self.network_latency_s is not None:
            base = network or Link(0.0, float("inf"), measured=False)
            network = Link(base.latency_s if self.network_latency_s is None else self.network_latency_s,
                           base.bytes_per_s if self.network_bytes_per_s is None else self.network_bytes_per_s,
                           measured=False)
        gpus = model.gpus_per_node if self.gpus_per_node is None else self.gpus_per_node
        return replace(model, links=links, network=network, gpus_per_node=gpus)


def describe_links(model: StepTimeModel, max_degree: int) -> list[str]:
    """One line per group size 2..max_degree: the all-to-all figures used, measured or assumed."""
    lines = []
    degree = 2
    while degree <= max_degree:
        local = model.link(degree)
        inside = f"NVLink {local.latency_s * 1e6:.0f} us + {local.bytes_per_s / 1e9:.0f} GB/s " \
                 f"({'measured' if local.measured else 'assumed'})"
        if degree > model.gpus_per_node and model.network is not None:
            net = model.network
            remote = (degree - model.gpus_per_node) / (degree - 1)
            inside += (f"; spans {degree // model.gpus_per_node} nodes: {remote:.0%} of the bytes over the network "
                       f"{net.latency_s * 1e6:.0f} us + {net.bytes_per_s / 1e9:.0f} GB/s per GPU "
                       f"({'measured' if net.measured else 'assumed'})")
        lines.append(f"d={degree}: {inside}")
        degree *= 2
    return lines


@dataclass(frozen=True)
class StepTime:
    """Modelled time of one step of a plan (seconds)."""

    step_s: float
    """The busiest rank's time: everyone waits for it."""
    compute_s: float
    """Linear + attention of the busiest rank."""
    exposed_all_to_all_s: float
    """All-to-all of the busiest rank not hidden under attention."""
    idle_s: float
    """Mean over ranks of the time spent waiting for the busiest rank."""
    rank_s: list[float] = field(default_factory=list, repr=False)
    """Per-rank time."""
    mean_compute_s: float = 0.0
    """Mean over ranks of linear + attention: with `mean_exposed_all_to_all_s` and `idle_s` it
    sums to `step_s` (where a rank's step goes, on average)."""
    mean_exposed_all_to_all_s: float = 0.0
    """Mean over ranks of the all-to-all not hidden under attention."""

    def summary(self) -> dict[str, float]:
        return {"step_time_s": self.step_s, "compute_s": self.compute_s,
                "exposed_all_to_all_s": self.exposed_all_to_all_s, "idle_s": self.idle_s,
                "mean_compute_s": self.mean_compute_s, "mean_exposed_all_to_all_s": self.mean_exposed_all_to_all_s}


def plan_step_time(plan, tokens_by_id: Mapping[str, int], model: StepTimeModel, num_heads: int,
                   num_kv_heads: int, head_dim: int, overlap: bool = True) -> StepTime:
    """Modelled step time of `plan` (its packs in each rank's `rank_order`, module docstring);
    vectorised over (rank, pack) entries in execution order."""
    index = {pack.id: k for k, pack in enumerate(plan.packs)}
    lengths = [[tokens_by_id[s] for s in pack.sequences] for pack in plan.packs]
    sum_l = np.array([sum(row) for row in lengths], dtype=float)
    sum_l2 = np.array([sum(n * n for n in row) for row in lengths], dtype=float)
    degree = np.array([pack.degree for pack in plan.packs], dtype=np.int64)
    first = np.array([pack.ranks[0] for pack in plan.packs], dtype=np.int64)
    ranks = np.array([r for r in range(plan.world_size) for _ in plan.rank_order.get(r, ())], dtype=np.int64)
    entry = np.array([index[i] for r in range(plan.world_size) for i in plan.rank_order.get(r, ())], dtype=np.int64)
    return _entries_step_time((sum_l, sum_l2, degree, first), ranks, entry, plan.world_size, model,
                              (num_heads, num_kv_heads, head_dim), overlap)


def hsf_packs_step_time(packs: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], world_size: int,
                        model: StepTimeModel, num_heads: int, num_kv_heads: int, head_dim: int,
                        overlap: bool = True) -> StepTime:
    """`plan_step_time` of packs given as arrays (Σ L, Σ L², degree, first rank), listed in the
    global HSF order that every rank's `rank_order` restricts (planning/schedule.py): the same
    entries in the same order, so the same figures bit for bit, without building a Plan."""
    sum_l, sum_l2, degree, first = packs
    entry = np.repeat(np.arange(len(degree), dtype=np.int64), degree)
    offsets = np.arange(len(entry), dtype=np.int64) - np.repeat(np.cumsum(degree) - degree, degree)
    ranks = first[entry] + offsets
    order = np.argsort(ranks, kind="stable")  # within a rank, packs stay in HSF order
    return _entries_step_time(packs, ranks[order], entry[order], world_size, model,
                              (num_heads, num_kv_heads, head_dim), overlap)


def _entries_step_time(packs, ranks: np.ndarray, entry: np.ndarray, world_size: int, model: StepTimeModel,
                       heads: tuple[int, int, int], overlap: bool) -> StepTime:
    """Step time from per-pack arrays and the (rank, pack) entries sorted by rank, then execution order."""
    sum_l, sum_l2, degree, first = packs
    num_heads, num_kv_heads, head_dim = heads
    comm = np.zeros(len(degree))
    for d in np.unique(degree).tolist():
        on = degree == d
        comm[on] = model.all_to_all_s(sum_l[on], int(d), num_heads, num_kv_heads, head_dim)
    share = np.zeros(len(entry))
    for d in np.unique(degree).tolist():
        on = degree[entry] == d
        table = np.asarray(heads_per_rank(num_heads, num_kv_heads, int(d)), dtype=float) / num_heads
        share[on] = table[ranks[on] - first[entry[on]]]
    local = degree[entry] == 1
    # A rank's consecutive degree-1 packs run as one attention call (sp/layout.py attention_units):
    # one per-call floor for the run.
    joins_run = np.concatenate([[False], local[1:] & local[:-1] & (ranks[1:] == ranks[:-1])])
    attention = model.attention_s(sum_l2[entry], sum_l[entry], share, packs=np.where(joins_run, 0, 1))
    previous = np.concatenate([[0.0], attention[:-1]])
    previous[np.concatenate([[True], ranks[1:] != ranks[:-1]])] = 0.0  # a rank's first pack hides nothing
    exposed_entry = np.maximum(0.0, comm[entry] - previous) if overlap else comm[entry]
    held = np.bincount(ranks, weights=sum_l[entry] / degree[entry], minlength=world_size)
    compute = np.bincount(ranks, weights=attention, minlength=world_size)
    compute += np.where(held > 0, model.linear_s(held), 0.0)
    exposed = np.bincount(ranks, weights=exposed_entry, minlength=world_size)
    total = compute + exposed
    busiest = int(np.argmax(total))
    return StepTime(float(total[busiest]), float(compute[busiest]), float(exposed[busiest]),
                    float((total[busiest] - total).mean()), total.tolist(), float(compute.mean()),
                    float(exposed.mean()))


def sequence_terms(tokens: np.ndarray, model: StepTimeModel) -> tuple[np.ndarray, np.ndarray]:
    """(attention, linear) seconds of each whole sequence on one rank with all heads, no floors."""
    a, b, _ = model.attention_fit
    s, _ = model.linear_fit
    return model.num_layers * (a * tokens * tokens + b * tokens), model.num_layers * s * tokens


def sharding_overhead(tokens: np.ndarray, degree: int, model: StepTimeModel, num_heads: int,
                      num_kv_heads: int, head_dim: int, overlap: bool, packing: tuple[int, int] | None = None
                      ) -> np.ndarray:
    """Per-rank seconds a sequence pays at `degree` ≥ 2 beyond its share of the work: its pack's
    attention floor and its all-to-all (with overlap, the part longer than its pack's attention on
    the busiest rank: the planner's proxy for 'hidden under the neighbouring pack').
    `packing` (h_pack, H_pack): a sequence shorter than h_pack shares a pack of about H_pack tokens
    with others of its group (planning/packing.py), so it pays its share L ÷ H_pack of that pack's
    floor and exposed all-to-all (the pack taken as H_pack ÷ L copies of it), not one of its own;
    None: every sequence alone in its pack."""
    tokens = np.asarray(tokens, dtype=float)
    pack = tokens if packing is None else np.where(tokens < packing[0], float(packing[1]), tokens)
    fraction = tokens / np.maximum(pack, 1.0)
    comm = model.all_to_all_s(pack, degree, num_heads, num_kv_heads, head_dim)
    if overlap:
        share = max(heads_per_rank(num_heads, num_kv_heads, degree)) / num_heads
        attention, _ = sequence_terms(tokens, model)
        comm = np.maximum(0.0, comm - attention * share / np.maximum(fraction, 1e-30))
    return fraction * (comm + model.num_layers * model.attention_fit[2])
