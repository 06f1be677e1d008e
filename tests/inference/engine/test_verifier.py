"""Greedy verification against a simple sequential reference, plus structural checks of the sampler."""

from __future__ import annotations

import pytest
import torch

from specheads.inference.engine.sampling import SamplingParams
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult, verify, verify_greedy, verify_stochastic

VOCAB = 8


pytestmark = pytest.mark.usefixtures("one_thread")


# --- references ---------------------------------------------------------------------------------


def reference_walk(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Walk from the root; at each node follow the first child whose token is the target's argmax there.

    Returns (path of node indices, committed tokens = accepted draft tokens + bonus).
    """
    tokens = tree.tokens.tolist()
    node, path = 0, [0]
    while True:
        choice = int(logits[node].argmax())
        nxt = next((c for c in tree.children[node] if tokens[c] == choice), None)
        if nxt is None:
            return path, [tokens[i] for i in path[1:]] + [choice]
        node = nxt
        path.append(node)


def reference_deepest(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], list[int]]:
    """Every node whose whole root path matches the argmaxes; keep the deepest, first in node order."""
    tokens = tree.tokens.tolist()
    accepted: list[tuple[int, list[int]]] = []  # (node, path)

    def visit(node: int, path: list[int]) -> None:
        accepted.append((node, path))
        choice = int(logits[node].argmax())
        for c in tree.children[node]:
            if tokens[c] == choice:
                visit(c, path + [c])

    visit(0, [0])
    node, path = min(accepted, key=lambda a: (-len(a[1]), a[0]))
    return path, [tokens[i] for i in path[1:]] + [int(logits[node].argmax())]


# --- random trees -------------------------------------------------------------------------------


def random_tree(n: int, g: torch.Generator, vocab: int = VOCAB, distinct_siblings: bool = True) -> DraftTree:
    parents = [-1]
    tokens = [int(torch.randint(0, vocab, (1,), generator=g))]
    used: dict[int, set[int]] = {}
    for i in range(1, n):
        for _ in range(100):
            p = int(torch.randint(0, i, (1,), generator=g))
            free = [t for t in range(vocab) if t not in used.get(p, set())] if distinct_siblings else list(range(vocab))
            if free:
                break
        tok = free[int(torch.randint(0, len(free), (1,), generator=g))]
        used.setdefault(p, set()).add(tok)
        parents.append(p)
        tokens.append(tok)
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents))


def rigged_logits(tree: DraftTree, g: torch.Generator, vocab: int = VOCAB) -> torch.Tensor:
    """Random logits, pushed so the target's argmax follows the path to a random deep node."""
    logits = torch.randn(tree.size, vocab, generator=g)
    deepest = (tree.depths == tree.max_depth).nonzero().squeeze(1)
    goal = int(deepest[torch.randint(0, deepest.shape[0], (1,), generator=g)])
    path = tree.path_to(goal)
    # Follow the path most of the way; sometimes break it to end inside the tree.
    stop = int(torch.randint(1, len(path) + 1, (1,), generator=g)) if torch.rand(1, generator=g) < 0.5 else len(path)
    for a, b in zip(path[: stop - 1], path[1:stop], strict=True):
        logits[a, tree.tokens[b]] += 10.0
    return logits


def check_result(result: VerifyResult, tree: DraftTree) -> None:
    path = result.path.tolist()
    assert path[0] == 0
    assert result.path.dtype == torch.long and result.tokens.dtype == torch.long
    assert all(int(tree.parents[b]) == a for a, b in zip(path, path[1:], strict=False))
    assert result.num_accepted == len(path) - 1
    assert result.tokens.shape == (result.num_accepted + 1,)
    assert result.tokens[:-1].tolist() == tree.tokens[path[1:]].tolist()


# --- greedy -------------------------------------------------------------------------------------


@pytest.mark.parametrize("rigged", [False, True])
def test_greedy_matches_sequential_reference_on_random_trees(rigged):
    g = torch.Generator().manual_seed(100 + rigged)
    lengths = []
    for _ in range(400):
        tree = random_tree(int(torch.randint(1, 26, (1,), generator=g)), g)
        logits = rigged_logits(tree, g) if rigged else torch.randn(tree.size, VOCAB, generator=g) * 2
        result = verify_greedy(tree, logits)
        check_result(result, tree)
        path, tokens = reference_walk(tree, logits)
        assert (result.path.tolist(), result.tokens.tolist()) == (path, tokens)
        assert reference_deepest(tree, logits) == (path, tokens)  # both references agree on distinct siblings
        assert result.num_accepted == len(path) - 1
        lengths.append(result.num_accepted)
    # The random cases exercise short and (when rigged) long accepted paths.
    assert max(lengths) >= (6 if rigged else 2)
    assert min(lengths) == 0
    if rigged:
        assert sum(lengths) / len(lengths) > 2.0


def test_greedy_chains_accept_the_matching_prefix():
    g = torch.Generator().manual_seed(7)
    for _ in range(200):
        n = int(torch.randint(1, 10, (1,), generator=g))
        tree = DraftTree.chain(torch.randint(0, VOCAB, (n,), generator=g))
        logits = torch.randn(n, VOCAB, generator=g)
        for i in range(n - 1):  # mostly the draft is right
            if torch.rand(1, generator=g) < 0.8:
                logits[i, tree.tokens[i + 1]] += 10.0
        argmax = logits.argmax(-1).tolist()
        accepted = 0
        while accepted < n - 1 and int(tree.tokens[accepted + 1]) == argmax[accepted]:
            accepted += 1
        result = verify_greedy(tree, logits)
        assert result.path.tolist() == list(range(accepted + 1))
        assert result.tokens.tolist() == tree.tokens[1 : accepted + 1].tolist() + [argmax[accepted]]


def test_root_only_returns_just_the_bonus():
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5]])
    result = verify_greedy(DraftTree.root_only(3), logits)
    assert result.path.tolist() == [0]
    assert result.tokens.tolist() == [1]
    assert result.num_accepted == 0


def test_all_children_rejected_gives_bonus_at_root():
    tree = DraftTree(tokens=torch.tensor([0, 1, 2, 3]), parents=torch.tensor([-1, 0, 0, 1]))
    logits = torch.zeros(4, VOCAB)
    logits[0, 5] = 1.0
    logits[1, 3] = 1.0  # would accept node 3, but its parent is rejected
    result = verify_greedy(tree, logits)
    assert result.path.tolist() == [0] and result.tokens.tolist() == [5]


def test_verify_dispatches_to_greedy_at_temperature_zero():
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        tree = random_tree(12, g)
        logits = rigged_logits(tree, g)
        a = verify(tree, logits, SamplingParams())
        b = verify_greedy(tree, logits)
        assert torch.equal(a.path, b.path) and torch.equal(a.tokens, b.tokens)
        # top-k / top-p never change the argmax, and greedy ignores draft_probs.
        c = verify(tree, logits, SamplingParams(temperature=0.0, top_k=2, top_p=0.3))
        assert torch.equal(c.tokens, b.tokens)


def test_tie_between_equally_deep_branches_prefers_first_in_node_order():
    # Two siblings with the same token (a proposer that does not dedupe), both matched by the target:
    #   0 ─┬─ 1(tok 4) ── 3(tok 6)
    #      └─ 2(tok 4) ── 4(tok 6)
    tree = DraftTree(tokens=torch.tensor([0, 4, 4, 6, 6]), parents=torch.tensor([-1, 0, 0, 1, 2]))
    logits = torch.zeros(5, VOCAB)
    logits[0, 4] = logits[1, 6] = logits[2, 6] = 1.0
    logits[3, 1] = 1.0
    logits[4, 2] = 1.0
    result = verify_greedy(tree, logits)
    assert result.path.tolist() == [0, 1, 3]
    assert result.tokens.tolist() == [4, 6, 1]
    assert (result.path.tolist(), result.tokens.tolist()) == reference_deepest(tree, logits)


def test_tie_is_first_in_node_order_not_first_branch():
    # Node order decides between equally deep nodes, even when the later branch starts first:
    #   0 ─┬─ 1(tok 4) ── 4(tok 6)
    #      └─ 2(tok 4) ── 3(tok 6)
    tree = DraftTree(tokens=torch.tensor([0, 4, 4, 6, 6]), parents=torch.tensor([-1, 0, 0, 2, 1]))
    logits = torch.zeros(5, VOCAB)
    logits[0, 4] = logits[1, 6] = logits[2, 6] = 1.0
    result = verify_greedy(tree, logits)
    assert result.path.tolist() == [0, 2, 3]
    assert (result.path.tolist(), result.tokens.tolist()) == reference_deepest(tree, logits)


def test_deeper_branch_wins_over_earlier_shallower_one():
    #   0 ─┬─ 1(tok 4)                 (matches, leaf)
    #      └─ 2(tok 4) ── 3(tok 6)     (matches twice)
    tree = DraftTree(tokens=torch.tensor([0, 4, 4, 6]), parents=torch.tensor([-1, 0, 0, 2]))
    logits = torch.zeros(4, VOCAB)
    logits[0, 4] = logits[2, 6] = 1.0
    result = verify_greedy(tree, logits)
    assert result.path.tolist() == [0, 2, 3]
    assert result.tokens.tolist() == [4, 6, 0]


def test_greedy_with_duplicate_siblings_matches_deepest_reference():
    g = torch.Generator().manual_seed(11)
    for _ in range(300):
        tree = random_tree(int(torch.randint(1, 20, (1,), generator=g)), g, vocab=3, distinct_siblings=False)
        logits = rigged_logits(tree, g, vocab=3)
        result = verify_greedy(tree, logits)
        check_result(result, tree)
        assert (result.path.tolist(), result.tokens.tolist()) == reference_deepest(tree, logits)


# --- stochastic: structure only (distributions are checked in test_exactness.py) -----------------


def random_sampled_tree(n: int, g: torch.Generator) -> DraftTree:
    tree = random_tree(n, g)
    return DraftTree(tokens=tree.tokens, parents=tree.parents,
                     draft_probs=torch.softmax(torch.randn(n, VOCAB, generator=g), -1))


@pytest.mark.parametrize("with_probs", [True, False])
def test_stochastic_results_are_well_formed_and_seeded(with_probs):
    g = torch.Generator().manual_seed(5)
    params = SamplingParams(temperature=0.8, top_k=5)
    for i in range(200):
        tree = random_sampled_tree(int(torch.randint(1, 15, (1,), generator=g)), g)
        if not with_probs:
            tree = DraftTree(tokens=tree.tokens, parents=tree.parents)
        logits = rigged_logits(tree, g)
        a = verify(tree, logits, params, torch.Generator().manual_seed(i))
        b = verify(tree, logits, params, torch.Generator().manual_seed(i))
        check_result(a, tree)
        assert torch.equal(a.path, b.path) and torch.equal(a.tokens, b.tokens)
        # The bonus is a token the processed target distribution allows at the last accepted node.
        last = int(a.path[-1])
        assert params.probs(logits[last])[a.tokens[-1]] > 0


def test_stochastic_accepts_everything_when_target_is_certain():
    tree = DraftTree.chain(torch.tensor([0, 3, 5, 1]), draft_probs=torch.full((4, VOCAB), 1.0 / VOCAB))
    probs = torch.zeros(4, VOCAB)
    probs[0, 3] = probs[1, 5] = probs[2, 1] = probs[3, 7] = 1.0
    for seed in range(20):
        result = verify_stochastic(tree, probs, torch.Generator().manual_seed(seed))
        assert result.path.tolist() == [0, 1, 2, 3] and result.tokens.tolist() == [3, 5, 1, 7]


def test_stochastic_never_accepts_a_token_the_target_excludes():
    # Target never picks 3 after the root, so both drafts of 3 (with and without draft_probs) are rejected
    # and the bonus comes from the residual, which excludes the rejected token (q is one-hot on it).
    probs = torch.zeros(3, VOCAB)
    probs[0, 2] = probs[0, 6] = 0.5
    probs[1] = probs[2] = 1.0 / VOCAB
    q = torch.zeros(3, VOCAB)
    q[0, 3] = 0.9
    q[0, 2] = 0.1
    for draft_probs in (q, None):
        tree = DraftTree(tokens=torch.tensor([0, 3, 1]), parents=torch.tensor([-1, 0, 1]), draft_probs=draft_probs)
        seen = set()
        for seed in range(100):
            result = verify_stochastic(tree, probs, torch.Generator().manual_seed(seed))
            assert result.path.tolist() == [0]
            seen.add(int(result.tokens[0]))
        assert seen == {2, 6}


def test_stochastic_deterministic_drafts_remove_rejected_tokens_from_the_bonus():
    # With one-hot drafts, each rejected child's token is removed from the target row before the bonus.
    probs = torch.zeros(3, VOCAB)
    probs[0, :3] = torch.tensor([0.2, 0.3, 0.5])
    probs[1:] = 1.0 / VOCAB
    tree = DraftTree(tokens=torch.tensor([7, 0, 1]), parents=torch.tensor([-1, 0, 0]))
    counts = torch.zeros(VOCAB)
    for seed in range(400):
        result = verify_stochastic(tree, probs, torch.Generator().manual_seed(seed))
        if result.num_accepted == 0:
            counts[result.tokens[0]] += 1
    assert counts[0] == 0 and counts[1] == 0 and counts[2] > 0
