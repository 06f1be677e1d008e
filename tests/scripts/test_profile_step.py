"""scripts/profile_step.py: the buckets of a step, and the bytes it counts as weight reads."""

from __future__ import annotations

import torch

from specheads.inference.engine.cache import TreeKVCache, cache_kwargs
from specheads.inference.engine.tree import DraftTree
from tests.conftest import tiny_model
from tests.scripts import load_script


def _script():
    return load_script("profile_step")


def test_a_verify_is_split_into_buckets_with_the_cache_writes_counted_apart(one_thread):
    script, model = _script(), tiny_model()
    context = 12
    cache = TreeKVCache(model.config, 64)
    tree = DraftTree(tokens=torch.tensor([5, 6, 7, 8]), parents=torch.tensor([-1, 0, 0, 1]))
    with torch.inference_mode(), script.annotated_cache_updates():
        model(input_ids=torch.arange(3, 3 + context)[None], **cache_kwargs(model, cache), logits_to_keep=1)
        seconds = script.split(model, cache, context, tree)
    assert cache.seq_length == context  # each profiled forward leaves the cache as it found it
    assert seconds["products"] > 0 and seconds["cache"] > 0 and seconds["norms/elementwise"] > 0, seconds
    assert sum(seconds[b] for b in script.BUCKETS) >= seconds["wall"] * (1 - 1e-9)
    # Outside the context manager the cache's update is the library's own again.
    from specheads.inference.engine import cache as cache_module

    assert "annotated" not in cache_module._GrowableLayer.update.__qualname__


def test_weight_bytes_count_every_matrix_once_the_lm_head_included():
    script, model = _script(), tiny_model()
    matrices = {m.weight.data_ptr(): m.weight.numel() * m.weight.element_size()
                for m in model.modules() if isinstance(m, torch.nn.Linear)}  # the LM head is a Linear, tied or not
    assert script.weight_bytes(model) == sum(matrices.values())
