"""A batch of sequences of different lengths, each with its own draft tree, verified in one forward, gives every
row the logits it gets alone; commits keep each row's own path, and freeing a row moves another without change."""

from __future__ import annotations

import torch

from specheads.inference.engine.batch_cache import BatchKVCache, batch_tree_mask
from specheads.inference.engine.cache import TreeKVCache, cache_kwargs
from specheads.inference.engine.forward import tree_forward
from specheads.inference.engine.tree import DraftTree


def random_tree(root: int, size: int, seed: int) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, size)]
    tokens = [root] + torch.randint(3, 90, (size - 1,), generator=g).tolist()
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents))


class Alone:
    """One sequence with its own cache, decoded as the batch-of-one engine does."""

    def __init__(self, model, prefix: list[int]) -> None:
        self.model, self.cache = model, TreeKVCache(model.config, 64)
        model(input_ids=torch.tensor([prefix]), **cache_kwargs(model, self.cache))

    def verify(self, tree: DraftTree) -> torch.Tensor:  # [N, V]
        return tree_forward(self.model, self.cache, tree).logits[0]

    def commit(self, prefix_length: int, path: torch.Tensor) -> None:
        self.cache.commit(prefix_length, path)


def batch_forward(model, cache: BatchKVCache, first_row: int, trees: list[DraftTree]) -> torch.Tensor:
    """One forward over consecutive rows from `first_row`, trees padded to a common width: [B, W, V]."""
    lengths = cache.lengths[first_row : first_row + len(trees)]
    width = max(t.size for t in trees)
    tokens = torch.zeros(len(trees), width, dtype=torch.long)
    positions = torch.zeros(len(trees), width, dtype=torch.long)
    for b, (tree, length) in enumerate(zip(trees, lengths)):
        tokens[b, : tree.size] = tree.tokens
        positions[b, : tree.size] = tree.depths + length
        positions[b, tree.size :] = length  # padding: any position; its outputs are never read
    mask = batch_tree_mask(trees, lengths, model.dtype, torch.device("cpu"))
    with torch.no_grad():
        return model(input_ids=tokens, position_ids=positions, attention_mask=mask,
                     **cache_kwargs(model, cache.window(first_row, len(trees)))).logits


def test_a_batch_of_trees_verifies_as_each_tree_alone(target):
    torch.manual_seed(0)
    prompts = [torch.randint(3, 90, (n,)).tolist() for n in (5, 17, 9)]
    alone = [Alone(target, p[:-1]) for p in prompts]
    cache = BatchKVCache(target.config, rows=4, capacity=16)  # small: the buffers must grow on the way
    for p in prompts:  # each newcomer prefills alone into its row: a chain over its prompt minus the last token
        row = cache.add_row()
        batch_forward(target, cache, row, [DraftTree.chain(torch.tensor(p[:-1]))])
        cache.commit(row, torch.arange(len(p) - 1))
    assert cache.lengths == [4, 16, 8]

    roots = [p[-1] for p in prompts]
    for step in range(3):
        trees = [random_tree(root, size, seed=10 * step + b) for b, (root, size) in enumerate(zip(roots, (6, 1, 9)))]
        logits = batch_forward(target, cache, 0, trees)
        for b, (tree, one) in enumerate(zip(trees, alone)):
            want = one.verify(tree)
            torch.testing.assert_close(logits[b, : tree.size], want, rtol=1e-4, atol=1e-4)
            # accept the deepest node's path (varied lengths and shapes), then its target argmax as the bonus
            deepest = int(tree.depths.argmax())
            path = [i for i in range(tree.size) if bool(tree.ancestors[deepest, i])]
            prefix = cache.lengths[b]
            cache.commit(b, torch.tensor(path))
            one.commit(prefix, torch.tensor(path))
            assert cache.lengths[b] == one.cache.seq_length
            roots[b] = int(want[deepest].argmax())

    # The middle sequence finishes: the last one moves into its row and decodes on unchanged.
    assert cache.remove_row(1) == 2 and cache.lengths == [alone[0].cache.seq_length, alone[2].cache.seq_length]
    trees = [random_tree(roots[0], 4, seed=99), random_tree(roots[2], 7, seed=98)]
    logits = batch_forward(target, cache, 0, trees)
    for b, (tree, one) in enumerate(zip(trees, (alone[0], alone[2]))):
        torch.testing.assert_close(logits[b, : tree.size], one.verify(tree), rtol=1e-4, atol=1e-4)


def test_the_mask_shows_each_row_its_prefix_and_ancestors_only():
    trees = [DraftTree(tokens=torch.tensor([5, 6, 7]), parents=torch.tensor([-1, 0, 0])), DraftTree.root_only(9)]
    visible = batch_tree_mask(trees, [2, 4], torch.float32, torch.device("cpu"))[:, 0] == 0
    assert visible.shape == (2, 3, 7)
    assert visible[0].tolist() == [
        [True, True, True, False, False, False, False],  # root: prefix + itself
        [True, True, True, True, False, False, False],  # child 1: not its sibling, not row 1's longer prefix
        [True, True, True, False, True, False, False],
    ]
    assert visible[1].tolist() == [
        [True, True, True, True, True, False, False],
        [False, False, False, False, False, True, False],  # padding: only its own slot
        [False, False, False, False, False, False, True],
    ]
