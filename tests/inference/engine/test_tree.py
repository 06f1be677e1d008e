"""DraftTree: derived structure (depths, ancestors, children), constructors, paths and truncation."""

from __future__ import annotations

import pytest
import torch

from specheads.inference.engine.tree import DraftTree

# A tree in depth-first node order, so truncation has to remap parents:
#
#   0 ─┬─ 1 ─┬─ 2 ── 3
#      │     └─ 6
#      └─ 4 ── 5
PARENTS = [-1, 0, 1, 2, 0, 4, 1]
DEPTHS = [0, 1, 2, 3, 1, 2, 2]
CHILDREN = ((1, 4), (2, 6), (3,), (), (5,), (), ())
TOKENS = [10, 11, 12, 13, 14, 15, 16]


def dfs_tree(with_probs: bool = True) -> DraftTree:
    probs = torch.softmax(torch.randn(len(PARENTS), 20, generator=torch.Generator().manual_seed(0)), -1)
    return DraftTree(tokens=torch.tensor(TOKENS), parents=torch.tensor(PARENTS),
                     draft_probs=probs if with_probs else None)


def random_tree(n: int, seed: int, vocab: int = 50) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]
    return DraftTree(tokens=torch.randint(0, vocab, (n,), generator=g), parents=torch.tensor(parents),
                     draft_probs=torch.rand(n, vocab, generator=g))


def test_depths_children_and_sizes():
    tree = dfs_tree()
    assert tree.depths.tolist() == DEPTHS
    assert tree.depths.dtype == torch.long
    assert tree.children == CHILDREN
    assert tree.size == 7 and tree.num_drafted == 6 and tree.max_depth == 3
    assert not tree.is_chain


def test_ancestors_matrix():
    tree = dfs_tree()
    expected = torch.zeros(7, 7, dtype=torch.bool)
    for i, path in enumerate([[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 4], [0, 4, 5], [0, 1, 6]]):
        expected[i, path] = True
    assert torch.equal(tree.ancestors, expected)
    assert tree.ancestors.dtype == torch.bool


@pytest.mark.parametrize("seed", range(10))
def test_structure_of_random_trees(seed):
    tree = random_tree(25, seed)
    parents = tree.parents.tolist()
    for i in range(tree.size):
        path = tree.path_to(i)
        assert path[0] == 0 and path[-1] == i
        assert all(parents[b] == a for a, b in zip(path, path[1:], strict=False))
        assert tree.depths[i] == len(path) - 1
        assert tree.ancestors[i].nonzero().squeeze(1).tolist() == sorted(path)
        assert tree.children[i] == tuple(j for j in range(tree.size) if parents[j] == i)
    assert sum(len(k) for k in tree.children) == tree.size - 1


def test_path_to():
    tree = dfs_tree()
    assert tree.path_to(0) == [0]
    assert tree.path_to(3) == [0, 1, 2, 3]
    assert tree.path_to(5) == [0, 4, 5]
    assert tree.path_to(6) == [0, 1, 6]


def test_chain_constructor():
    tokens = torch.tensor([7, 3, 9, 3, 1])
    probs = torch.rand(5, 12)
    chain = DraftTree.chain(tokens, probs)
    assert chain.parents.tolist() == [-1, 0, 1, 2, 3]
    assert chain.depths.tolist() == [0, 1, 2, 3, 4]
    assert chain.children == ((1,), (2,), (3,), (4,), ())
    assert chain.is_chain and chain.max_depth == 4 and chain.num_drafted == 4
    assert torch.equal(chain.tokens, tokens)
    assert chain.draft_probs is probs
    assert chain.path_to(4) == [0, 1, 2, 3, 4]
    assert torch.equal(chain.ancestors, torch.tril(torch.ones(5, 5, dtype=torch.bool)))
    assert DraftTree.chain(tokens).draft_probs is None


def test_chain_of_one_token_is_root_only():
    chain = DraftTree.chain(torch.tensor([5]))
    assert chain.size == 1 and chain.parents.tolist() == [-1] and chain.is_chain and chain.max_depth == 0


@pytest.mark.parametrize("token", [0, 42, torch.tensor(42), torch.tensor([42])])
def test_root_only_constructor(token):
    tree = DraftTree.root_only(token)
    assert tree.tokens.tolist() == [int(token)]
    assert tree.tokens.dtype == torch.long and tree.parents.dtype == torch.long
    assert tree.parents.tolist() == [-1]
    assert tree.draft_probs is None
    assert tree.size == 1 and tree.num_drafted == 0 and tree.max_depth == 0
    assert tree.depths.tolist() == [0] and tree.children == ((),)
    assert tree.is_chain and tree.path_to(0) == [0]


def test_is_chain():
    assert DraftTree(tokens=torch.tensor([1, 2, 3]), parents=torch.tensor([-1, 0, 1])).is_chain
    assert not DraftTree(tokens=torch.tensor([1, 2, 3]), parents=torch.tensor([-1, 0, 0])).is_chain
    # Branching below the root also breaks the chain.
    assert not DraftTree(tokens=torch.tensor([1, 2, 3, 4]), parents=torch.tensor([-1, 0, 1, 1])).is_chain


@pytest.mark.parametrize(
    ("max_depth", "keep", "new_parents"),
    [
        (0, [0], [-1]),
        (1, [0, 1, 4], [-1, 0, 0]),
        (2, [0, 1, 2, 4, 5, 6], [-1, 0, 1, 0, 3, 1]),
    ],
)
def test_truncated_remaps_parents_and_keeps_rows(max_depth, keep, new_parents):
    tree = dfs_tree()
    cut = tree.truncated(max_depth)
    assert cut.tokens.tolist() == [TOKENS[i] for i in keep]
    assert cut.parents.tolist() == new_parents
    assert cut.max_depth == max_depth
    assert torch.equal(cut.draft_probs, tree.draft_probs[keep])
    assert cut.depths.tolist() == [DEPTHS[i] for i in keep]


def test_truncated_without_draft_probs():
    cut = dfs_tree(with_probs=False).truncated(1)
    assert cut.draft_probs is None
    assert cut.parents.tolist() == [-1, 0, 0]


@pytest.mark.parametrize("max_depth", [3, 4, 100])
def test_truncated_deep_enough_is_unchanged(max_depth):
    tree = dfs_tree()
    assert tree.truncated(max_depth) is tree


@pytest.mark.parametrize("seed", range(8))
def test_truncated_random_trees(seed):
    tree = random_tree(30, seed)
    for max_depth in range(tree.max_depth + 1):
        cut = tree.truncated(max_depth)
        keep = [i for i in range(tree.size) if tree.depths[i] <= max_depth]
        assert cut.tokens.tolist() == tree.tokens[keep].tolist()
        assert torch.equal(cut.draft_probs, tree.draft_probs[keep])
        # Every kept node keeps its parent, under the new numbering.
        for new_i, old_i in enumerate(keep):
            old_parent = int(tree.parents[old_i])
            expected = -1 if old_parent < 0 else keep.index(old_parent)
            assert int(cut.parents[new_i]) == expected
        assert cut.max_depth == min(max_depth, tree.max_depth)


def test_invalid_trees_are_rejected():
    with pytest.raises(AssertionError):
        DraftTree(tokens=torch.tensor([1, 2]), parents=torch.tensor([0, 0]))  # root must have parent -1
    with pytest.raises(AssertionError):
        DraftTree(tokens=torch.tensor([1, 2, 3]), parents=torch.tensor([-1, 2, 0]))  # parent after child
    with pytest.raises(AssertionError):
        DraftTree(tokens=torch.tensor([1, 2, 3]), parents=torch.tensor([-1, 0]))  # shape mismatch
    with pytest.raises(AssertionError):
        DraftTree(tokens=torch.tensor([1, 2]), parents=torch.tensor([-1, 0]), draft_probs=torch.rand(3, 5))


def test_graft_follows_matching_nodes_and_adds_the_rest_within_budget():
    tree = dfs_tree(with_probs=False)
    # [11, 12, 99]: follows 1 -> 2, then adds 99 under node 2; [14, 15]: already there; [77]: a new root child.
    grafted = tree.graft([[11, 12, 99], [14, 15], [77]], max_new_nodes=5)
    assert grafted.tokens.tolist() == TOKENS + [99, 77]
    assert grafted.parents.tolist() == PARENTS + [2, 0]
    assert grafted.depths.tolist() == DEPTHS + [3, 1]
    assert tree.graft([[11, 12, 99], [77]], max_new_nodes=1).tokens.tolist() == TOKENS + [99]
    assert tree.graft([[11, 12, 13], [14]], max_new_nodes=5) is tree  # nothing new: the same tree


def test_graft_refuses_sampled_drafts():
    with pytest.raises(ValueError, match="sampled drafts"):
        dfs_tree(with_probs=True).graft([[1]], max_new_nodes=1)
