"""Where a prompt's pixels will be used, when the dealing of samples to ranks is fixed in advance.

`RankDealing(rank_nodes, n)`: GRPO sample (slot, k) goes to rank (slot * n + k) mod R, and rank r
runs on node `rank_nodes[r]` (`RayWorkerGroup.node_ids`). The rule depends only on the sample's
identity, never on which prompts of the step survived the bad-record policy, so it is known when
the loader dispatches the prompt's decode, one or more steps ahead: called with a `PromptKey` it
gives the loader's `destinations` (node -> number of the prompt's samples consumed there; see
`routing.route_near`). The loader bench deals this way; the trainer does not (the planner and
the rollout dealing decide after decoding; see routing.py), and uses the learned destinations.

Pure: no Ray, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flexrl_ds.loader.metastore import PromptKey, SampleId


@dataclass(frozen=True)
class RankDealing:
    """Sample (slot, k) -> rank (slot * n + k) mod len(rank_nodes); rank -> its node."""

    rank_nodes: tuple[str, ...]
    """Node id of each rank, in rank order."""
    num_samples_per_prompt: int
    """GRPO group size n."""

    def __post_init__(self) -> None:
        if not self.rank_nodes or self.num_samples_per_prompt < 1:
            raise ValueError(f"RankDealing needs ranks and n >= 1, got {len(self.rank_nodes)} ranks, "
                             f"n={self.num_samples_per_prompt}")

    def rank_of(self, sample: SampleId) -> int:
        return (sample.slot * self.num_samples_per_prompt + sample.sample_index) % len(self.rank_nodes)

    def shares(self, samples: Sequence[SampleId]) -> list[list[SampleId]]:
        """`samples` split per rank (in rank order, each share in the given order)."""
        out: list[list[SampleId]] = [[] for _ in self.rank_nodes]
        for sample in samples:
            out[self.rank_of(sample)].append(sample)
        return out

    def __call__(self, key: PromptKey) -> dict[str, float]:
        """Node -> how many of the prompt's n samples are consumed there."""
        weights: dict[str, float] = {}
        for k in range(self.num_samples_per_prompt):
            node = self.rank_nodes[self.rank_of(SampleId(key.step, key.slot, k))]
            weights[node] = weights.get(node, 0.0) + 1.0
        return weights
