"""The target's logits as its forward computes them: the map each family's config implies, by hand."""

from __future__ import annotations

import torch

from specheads.target_logits import LogitMap, logit_map
from tests.conftest import tiny_config


def test_the_map_is_each_familys_formula():
    x = torch.tensor([-90.0, -3.0, 0.0, 2.5, 60.0])
    assert logit_map(tiny_config("llama")) == LogitMap() and LogitMap()(x) is x
    assert logit_map(tiny_config("granite")) == LogitMap(scale=0.25)  # logits_scaling 4: divided
    torch.testing.assert_close(logit_map(tiny_config("granite"))(x), x / 4)
    capped = logit_map(tiny_config("gemma2"))
    assert capped.softcap == 30.0
    torch.testing.assert_close(capped(x), 30.0 * torch.tanh(x / 30.0))
    assert capped(x).abs().max() < 30.0 and capped(x)[2] == 0.0
