"""The weight channel's receiving end inside a vLLM engine's workers (no vLLM import here).

A separate vLLM engine (a Ray actor of its own) holds its model in its workers: one in process for a
single GPU, one process per shard for `tensor_parallel_size` > 1. `WeightReceiverExtension` is
handed to vLLM as `worker_extension_cls`, so vLLM adds its methods to every worker and
`LLM.collective_rpc` reaches them by name. Each worker joins policy rank 0's weight channel
(runtime/weight_channel.py) as receiver `first_rank + worker rank` and loads the full HF-named
tensors of every bucket into its own model: vLLM's `load_weights` keeps the shard that worker
holds. So the buckets go straight from the sender to the workers, as the broadcast delivers them.
"""

from __future__ import annotations

from typing import Any

from flexrl_ds.runtime.weight_channel import ChannelAddress, WeightChannel

EXTENSION = "flexrl_ds.rollout.vllm_workers.WeightReceiverExtension"
"""Qualified name given to vLLM as `worker_extension_cls`."""


class WeightReceiverExtension:
    """Methods vLLM mixes into each worker. vLLM's Worker provides `rank` and `get_model()`; vLLM
    refuses an extension that defines a name its Worker has, so only `flexrl_*` names live here."""

    rank: int  # annotation only: no attribute, no clash

    def flexrl_join_weight_channel(self, address: dict[str, Any], first_rank: int) -> int:
        """Join the channel as receiver `first_rank + rank` (blocks until every rank has joined)."""
        channel_rank = first_rank + self.rank
        self.flexrl_channel = WeightChannel(ChannelAddress(**address), channel_rank)
        return channel_rank

    def flexrl_receive_weights(self) -> int:
        """Load one sync's buckets as they arrive; returns the tensors loaded."""
        model = self.get_model()  # type: ignore[attr-defined]  # vLLM's Worker has it
        return self.flexrl_channel.load_each(lambda bucket: model.load_weights(iter(bucket)))
