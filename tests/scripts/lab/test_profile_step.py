"""scripts/lab/profile_step.py: the buckets of a step, and the bytes it counts as weight reads."""

from __future__ import annotations

import pytest
import torch

from specheads.inference.engine.batch_cache import BatchKVCache, _RowsLayer
from specheads.inference.engine.forward import prefill_forward
from specheads.inference.engine.lean_forward import lean_forward
from specheads.inference.engine.tree import DraftTree
from tests.conftest import tiny_model
from tests.scripts.lab import load_script


def _script():
    return load_script("profile_step")


@pytest.mark.parametrize("step", ["hf", "lean", "compiled"])
def test_a_verify_is_split_into_buckets_with_the_cache_writes_counted_apart(one_thread, step):
    script, model = _script(), tiny_model()
    context = 12
    cache = BatchKVCache(model.config, rows=1, capacity=64)
    cache.add_row()
    tree = DraftTree(tokens=torch.tensor([5, 6, 7, 8]), parents=torch.tensor([-1, 0, 0, 1]))
    lean = None if step == "hf" else lean_forward(model, compiled=step == "compiled")
    with torch.inference_mode(), script.annotated_cache_updates():
        prefill_forward(model, cache, 0, torch.arange(3, 3 + context))
        cache.commit(0, torch.arange(context))
        seconds = script.split(model, cache, tree, lean)
    assert cache.lengths == [context]  # each profiled forward leaves the cache as it found it
    assert seconds["products"] > 0 and seconds["cache"] > 0 and seconds["norms/elementwise"] > 0, seconds
    assert sum(seconds[b] for b in script.BUCKETS) >= seconds["wall"] * (1 - 1e-9)
    # Outside the context manager the cache's write is the library's own again.
    assert "annotated" not in _RowsLayer.write.__qualname__


def test_weight_bytes_count_every_matrix_once_the_lm_head_included():
    script, model = _script(), tiny_model()
    matrices = {m.weight.data_ptr(): m.weight.numel() * m.weight.element_size()
                for m in model.modules() if isinstance(m, torch.nn.Linear)}  # the LM head is a Linear, tied or not
    assert script.weight_bytes(model) == sum(matrices.values())
