"""The target's forwards the engine runs: a prompt's prefill, a verify step over every row's tree, and the lone
tree forward of the tree-attention check; with the one rule for which of them needs our attention mask."""

from __future__ import annotations

import weakref

import torch
from transformers import PreTrainedModel

from specheads.inference.engine.batch_cache import BatchKVCache, batch_tree_mask, causal_mask
from specheads.inference.engine.cache import TreeKVCache, cache_kwargs
from specheads.inference.engine.layer_attention import LayerAttention, layer_attention
from specheads.inference.engine.lean_forward import LeanForward
from specheads.inference.engine.tree import DraftTree


def model_max_context(model: PreTrainedModel) -> int | None:
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def needs_own_mask(attention: LayerAttention, lone_chain: bool) -> bool:
    """Whether an HF forward needs our 4-D mask. A lone chain (one row whose inputs follow each other: a prefill, plain
    decoding) is exactly what the model's own causal mask expresses; anything else (branches, several rows of other
    lengths) needs ours, and so does every forward of a model with sliding-window layers, since HF's masks do not
    window the cache's full-length layers."""
    return not lone_chain or attention.windowed


def _is_lone_chain(trees: list[DraftTree]) -> bool:
    return len(trees) == 1 and trees[0].is_plain_chain


def tree_forward(
    model: PreTrainedModel,
    cache: TreeKVCache,
    tree: DraftTree,
    *,
    output_hidden_states: bool = False,
):
    """One forward over all tree nodes on top of the cached prefix (positions = prefix + depth)."""
    device = model_device(model)
    prefix = cache.seq_length
    tokens = tree.input_tokens.to(device)[None]
    positions = (tree.input_depths.to(device) + prefix)[None]
    attention = layer_attention(model.config)
    mask = (batch_tree_mask([tree], [prefix], model.dtype, device, attention=attention)
            if needs_own_mask(attention, tree.is_plain_chain) else None)
    return model(
        **cache_kwargs(model, cache),
        input_ids=tokens,
        position_ids=positions,
        attention_mask=mask,
        output_hidden_states=output_hidden_states,
    )


def batch_forward(model: PreTrainedModel, cache: BatchKVCache, trees: list[DraftTree], first_row: int = 0, *,
                  output_hidden_states: bool = False, lean: LeanForward | None = None,
                  attention: LayerAttention | None = None):
    """One forward over rows first_row .. first_row + len(trees) - 1 of `cache`, row b's input `trees[b]` padded to the
    widest tree (positions = the row's length + depth); nothing is committed. With `lean`, that forward runs it
    (`lean_forward.py`) instead of the model's own. `attention`: the model's layer attention, when the caller has
    it (else read from its config)."""
    device = model_device(model)
    lengths = cache.lengths[first_row : first_row + len(trees)]
    width = max(t.input_size for t in trees)  # a tree's nodes, then its extra rows (`extra_rows.py`)
    tokens = torch.zeros(len(trees), width, dtype=torch.long)
    positions = torch.zeros(len(trees), width, dtype=torch.long)
    for b, (tree, length) in enumerate(zip(trees, lengths)):
        tokens[b, : tree.input_size] = tree.input_tokens.cpu()
        positions[b, : tree.input_size] = tree.input_depths.cpu() + length
        positions[b, tree.input_size :] = length  # padding: its outputs are never read
    window = cache.window(first_row, len(trees))
    lone_chain = _is_lone_chain(trees)
    if lean is not None:  # it windows its own masks; a lone chain needs no tree
        return lean(tokens.to(device), positions.to(device), window, None if lone_chain else trees,
                    output_hidden_states=output_hidden_states)
    attention = attention or layer_attention(model.config)
    mask = (batch_tree_mask(trees, lengths, model.dtype, device, attention=attention)
            if needs_own_mask(attention, lone_chain) else None)
    return model(input_ids=tokens.to(device), position_ids=positions.to(device), attention_mask=mask,
                 output_hidden_states=output_hidden_states, **cache_kwargs(model, window))


def prefill_forward(model: PreTrainedModel, cache: BatchKVCache, row: int, prompt: torch.Tensor, *,
                    output_hidden_states: bool = False, lean: LeanForward | None = None,
                    attention: LayerAttention | None = None):
    """One forward over a whole prompt [P] into the (empty) row `row`; logits only for its last position."""
    device = model_device(model)
    window = cache.window(row, 1)
    length = cache.lengths[row]
    if lean is not None:
        positions = torch.arange(length, length + prompt.shape[0], device=device)[None]
        return lean(prompt[None].to(device), positions, window, logits_to_keep=1,
                    output_hidden_states=output_hidden_states)
    attention = attention or layer_attention(model.config)
    width = prompt.shape[0]
    mask = (causal_mask([length], width, length + width, model.dtype, device, attention)
            if needs_own_mask(attention, lone_chain=True) else None)
    return model(input_ids=prompt[None].to(device), attention_mask=mask, **cache_kwargs(model, window),
                 logits_to_keep=1, output_hidden_states=output_hidden_states)


_checked_models: weakref.WeakSet = weakref.WeakSet()  # models that passed; weak so ids are never reused


@torch.inference_mode()
def check_tree_attention(model: PreTrainedModel) -> None:
    """Fail clearly if the model ignores 4-D attention masks or explicit position ids.

    Feeds a root with two sibling children and compares the second sibling's logits with
    a plain sequential forward over [prefix, root, sibling]; a model that lets siblings
    see each other (or ignores positions) disagrees.
    """
    if model in _checked_models:
        return
    device = model_device(model)
    vocab = model.config.get_text_config().vocab_size
    a, b, c, d = (int(x) % vocab for x in (11, 12, 13, 14))
    try:
        cache = TreeKVCache(model.config, capacity=8)
        model(input_ids=torch.tensor([[a]], device=device), **cache_kwargs(model, cache))
        tree = DraftTree(tokens=torch.tensor([b, c, d]), parents=torch.tensor([-1, 0, 0]))
        tree_logits = tree_forward(model, cache, tree).logits[0, 2].float()
        ref_logits = model(input_ids=torch.tensor([[a, b, d]], device=device)).logits[0, 2].float()
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(
            f"{type(model).__name__} cannot run tree verification (4-D attention mask with explicit "
            f"position_ids): {err}. Use a model whose attention accepts custom masks "
            "(e.g. attn_implementation='sdpa' or 'eager')"
        ) from err
    tol = 1e-3 if model.dtype == torch.float32 else 5e-2
    scale = ref_logits.abs().max().clamp(min=1.0)
    if not torch.allclose(tree_logits, ref_logits, atol=float(tol * scale), rtol=0):
        raise ValueError(
            f"{type(model).__name__} ignores the 4-D tree attention mask or position_ids (its logits for a "
            "tree node differ from a sequential forward), so speculative outputs would be wrong. "
            "Load it with attn_implementation='sdpa' or 'eager', or use method 'ar'"
        )
    _checked_models.add(model)
