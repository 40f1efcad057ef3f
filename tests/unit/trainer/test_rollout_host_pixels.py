"""RolloutHost.generate with a pixel source that loses an item: the step fails naming the prompt
and the items, instead of a bare KeyError (stand-ins for the pixel source and the engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from flexrl_ds.loader.metastore import PromptKey
from flexrl_ds.rollout.base import SamplingParams
from flexrl_ds.trainer.rollout_host import PromptJob, RolloutHost


class OneItemPixels:
    """Delivers item 0 of every request's prompt and nothing else; withdraws nothing."""

    def fetch(self, step, requests):
        delivered = [(request, {"pixel_values": torch.zeros(16, 1176)}) for request in requests
                     if request.item_index == 0]
        return SimpleNamespace(withdrawn={}, delivered=lambda: delivered, bytes_fetched=0)


def host() -> RolloutHost:
    stand_in = RolloutHost.__new__(RolloutHost)
    stand_in.pixels = OneItemPixels()
    stand_in.engine = SimpleNamespace(generate=lambda requests, params: [])
    return stand_in


def test_an_item_neither_delivered_nor_withdrawn_names_its_prompt():
    image = ("image", (1, 4, 4), 1.0)
    whole = PromptJob(PromptKey(3, 0), (1, 2), (image,), (("a/0", 1),))
    assert host().generate(3, [whole], SamplingParams()).withdrawn == {}
    lost = PromptJob(PromptKey(3, 1), (1, 2), (image, image, image), (("b/0", 1),))
    with pytest.raises(RuntimeError, match=r"step 3: prompt '.*': items \[1, 2\] were neither delivered nor withdrawn"):
        host().generate(3, [whole, lost], SamplingParams())
