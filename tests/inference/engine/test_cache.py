"""TreeKVCache: commit keeps exactly the accepted path's entries, as if only that path had been fed."""

from __future__ import annotations

import pytest
import torch

from specheads.inference.engine.cache import TreeKVCache, cache_kwargs
from specheads.inference.engine.forward import tree_forward
from specheads.inference.engine.tree import DraftTree
from tests.conftest import tiny_model


def test_commit_equals_sequential_prefill(target):
    prefix = torch.tensor([[5, 9, 13, 40, 7]])
    cache = TreeKVCache(target.config, capacity=4)  # tiny capacity: forces buffer growth
    target(input_ids=prefix, **cache_kwargs(target, cache))
    #        0   1   2   3   4   5
    tree = DraftTree(tokens=torch.tensor([11, 21, 22, 31, 32, 41]), parents=torch.tensor([-1, 0, 0, 2, 2, 4]))
    tree_forward(target, cache, tree)
    assert cache.seq_length == 5 + 6
    path = torch.tensor(tree.path_to(5))  # 0 -> 2 -> 4 -> 5
    cache.commit(5, path)
    assert cache.seq_length == 5 + 4

    ref = TreeKVCache(target.config)
    target(input_ids=torch.cat([prefix, tree.tokens[path][None]], dim=1), **cache_kwargs(target, ref))
    for got, want in zip(cache.layers, ref.layers):
        torch.testing.assert_close(got.keys, want.keys)
        torch.testing.assert_close(got.values, want.values)

    # The next forward on the committed cache equals a forward on the full sequence.
    nxt = torch.tensor([[50]])
    step = target(input_ids=nxt, position_ids=torch.tensor([[9]]), **cache_kwargs(target, cache)).logits
    full = target(input_ids=torch.cat([prefix, tree.tokens[path][None], nxt], dim=1)).logits[:, -1:]
    torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


def test_truncate_and_empty_commit(target):
    cache = TreeKVCache(target.config)
    target(input_ids=torch.tensor([[3, 4, 5, 6]]), **cache_kwargs(target, cache))
    cache.commit(4, torch.empty(0, dtype=torch.long))
    assert cache.seq_length == 4
    cache.truncate(2)
    assert cache.seq_length == 2 and cache.layers[0].keys.shape[2] == 2


def test_sliding_window_layers_keep_every_key_and_other_kinds_are_refused():
    from transformers import LlamaConfig, MistralConfig

    cfg = MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    cache = TreeKVCache(cfg)  # the window is the mask's business: a rollback may need any key again
    keys = torch.randn(1, 2, 20, 8)
    cache.layers[0].update(keys, keys)
    assert cache.seq_length == 20 and torch.equal(cache.layers[0].keys, keys)
    hybrid = LlamaConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    hybrid.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(ValueError, match="linear_attention layers, whose state a draft tree cannot branch"):
        TreeKVCache(hybrid)


def test_engine_rejects_models_that_ignore_tree_masks():
    from specheads.inference import Engine
    from specheads.inference.proposers import AutoregressiveProposer

    model = tiny_model("llama")

    class IgnoresMask(torch.nn.Module):
        """Wraps a model but drops the attention mask, like an architecture without 4-D mask support."""

        def __init__(self, inner):
            super().__init__()
            self.inner = inner
            self.config = inner.config
            self.dtype = inner.dtype

        def forward(self, attention_mask=None, **kwargs):
            return self.inner(**kwargs)

    with pytest.raises(ValueError, match="ignores the 4-D tree attention mask"):
        Engine(IgnoresMask(model), AutoregressiveProposer())
