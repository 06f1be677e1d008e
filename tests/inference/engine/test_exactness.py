"""Statistical exactness: speculative sampling must reproduce the target's own distribution.

The target and the draft are tiny Markov models (next-token logits conditioned on the last token),
so the target's distribution over the next two tokens is known exactly:
P(x1, x2) = p(x1 | root) p(x2 | x1), with p = SamplingParams.probs of the target's logits.
One speculative step drafts a tree from the draft model, the verifier commits its tokens, and
plain target sampling continues when fewer than two were committed. A chi-square test compares the
empirical joint of (x1, x2) with P. Seeds are fixed, so every p-value is deterministic.

A deliberately wrong verifier goes through the same statistics and must be rejected, which shows
the sample sizes give the test power.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specheads.inference.engine.extra_rows import ExtraRows
from specheads.inference.engine.sampling import SamplingParams, sample
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import verify

VOCAB = 6
ROOT = 2
SAMPLES = 10_000  # the weakest negative control is still rejected at p ~ 1e-27
PASS_P = 1e-3  # a correct verifier must not be rejected at this level
REJECT_P = 1e-6  # a flawed verifier must be rejected at this level


def markov_logits(seed: int, scale: float = 1.0) -> torch.Tensor:
    """[V, V]: row a holds the next-token logits after token a."""
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


TARGET = markov_logits(1)
# Correlated with the target but far from it (total variation 0.3-0.5 per row), so steps both accept
# and reject drafts often, and a verifier mistake shifts the output distribution visibly.
DRAFT = 0.5 * TARGET + markov_logits(2)

# The sampling settings under test; both models go through the same SamplingParams.probs.
T1 = SamplingParams(temperature=1.0)
T07_K3 = SamplingParams(temperature=0.7, top_k=3)
P08 = SamplingParams(temperature=1.0, top_p=0.8)

Verifier = Callable[[DraftTree, torch.Tensor, SamplingParams, torch.Generator], list[int]]


pytestmark = pytest.mark.usefixtures("one_thread")


# --- the simulated speculative step -------------------------------------------------------------


@functools.cache
def draft_table(params: SamplingParams) -> tuple[torch.Tensor, list[int]]:
    """The processed draft distribution after each token [V, V], and the size of each row's support."""
    q_table = params.probs(DRAFT)
    return q_table, (q_table > 0).sum(-1).tolist()


def draft_tree(params: SamplingParams, width: int, depth: int, gen: torch.Generator,
               deterministic: bool) -> DraftTree:
    """Children of each node: `width` draws without replacement from the processed draft distribution
    (or the draft's top-`width` tokens when deterministic). Nodes are in breadth-first order."""
    q_table, support = draft_table(params)
    tokens, parents, frontier = [ROOT], [-1], [0]
    for _ in range(depth):
        parent_tokens = [tokens[node] for node in frontier]
        if deterministic:
            kids = torch.topk(DRAFT[parent_tokens], width, dim=-1).indices.tolist()
        elif all(support[t] >= width for t in parent_tokens):
            # One call draws every frontier node's children (rows are sampled independently).
            kids = torch.multinomial(q_table[parent_tokens], width, replacement=False, generator=gen).tolist()
        else:
            # Without replacement there can be no more children than tokens the draft allows.
            kids = [torch.multinomial(q_table[t], min(width, support[t]), replacement=False, generator=gen).tolist()
                    for t in parent_tokens]
        nxt = []
        for node, node_kids in zip(frontier, kids, strict=True):
            for kid in node_kids:
                tokens.append(kid)
                parents.append(node)
                nxt.append(len(tokens) - 1)
        frontier = nxt
    draft_probs = None if deterministic else q_table[tokens]
    return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), draft_probs=draft_probs)


def real_verifier(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
                  gen: torch.Generator) -> list[int]:
    return verify(tree, target_logits, params, gen).tokens.tolist()


def first_two_tokens(verifier: Verifier, params: SamplingParams, width: int, depth: int,
                     deterministic: bool = False, samples: int = SAMPLES, seed: int = 0,
                     tree: DraftTree | None = None) -> np.ndarray:
    """Counts [V, V] of the first two generated tokens over `samples` speculative steps (of `tree`
    when given: a fixed tree of deterministic drafts)."""
    gen = torch.Generator().manual_seed(seed)
    fixed_tree = (tree if tree is not None
                  else draft_tree(params, width, depth, gen, deterministic) if deterministic else None)
    x1 = torch.empty(samples, dtype=torch.long)
    x2 = torch.full((samples,), -1, dtype=torch.long)
    for s in range(samples):
        tree = fixed_tree if fixed_tree is not None else draft_tree(params, width, depth, gen, deterministic)
        committed = verifier(tree, TARGET[tree.tokens], params, gen)
        x1[s] = committed[0]
        if len(committed) > 1:
            x2[s] = committed[1]
    # Only the bonus was committed: the next token comes from plain target sampling.
    todo = x2 < 0
    x2[todo] = sample(params.probs(TARGET)[x1[todo]], gen)
    return np.bincount((x1 * VOCAB + x2).numpy(), minlength=VOCAB * VOCAB).reshape(VOCAB, VOCAB)


def exact_joint(params: SamplingParams) -> np.ndarray:
    """P(x1, x2) = p(x1 | ROOT) p(x2 | x1), in float64."""
    p = params.probs(TARGET).double().numpy()
    return p[ROOT][:, None] * p


def chi_square_p(counts: np.ndarray, joint: np.ndarray, min_expected: float = 5.0) -> float:
    """Goodness of fit; cells expected fewer than `min_expected` times are pooled into one cell."""
    obs = counts.ravel().astype(np.float64)
    exp = joint.ravel() / joint.sum() * obs.sum()
    impossible = exp == 0
    assert obs[impossible].sum() == 0, "a token sequence the target cannot produce was generated"
    big = exp >= min_expected
    small = ~big & ~impossible
    f_obs, f_exp = list(obs[big]), list(exp[big])
    if small.any():
        if exp[small].sum() >= min_expected:
            f_obs.append(obs[small].sum())
            f_exp.append(exp[small].sum())
        else:  # too rare even pooled: fold into the smallest regular cell
            i = int(np.argmin(f_exp))
            f_obs[i] += obs[small].sum()
            f_exp[i] += exp[small].sum()
    assert len(f_obs) >= 4, "too few cells for a meaningful test"
    return float(chisquare(f_obs, f_exp).pvalue)


def accept_rate(params: SamplingParams, width: int, depth: int, deterministic: bool = False) -> float:
    """Mean accepted draft tokens per step on a few hundred steps (to show the drafts are exercised)."""
    gen = torch.Generator().manual_seed(99)
    total = 0
    for _ in range(300):
        tree = draft_tree(params, width, depth, gen, deterministic)
        total += verify(tree, TARGET[tree.tokens], params, gen).num_accepted
    return total / 300


# --- a flawed verifier for the negative controls ------------------------------------------------


def flawed_verifier(mistake: str) -> Verifier:
    """Sequential recursive rejection sampling with one classic mistake.

    - "resample_from_p": after a rejection keep the target row p instead of norm(max(p - q, 0)).
    - "no_q_update": ignore that children were drawn without replacement (q stays as drafted).
    - "shared_uniform": test every child of a node against the same uniform draw.
    """
    assert mistake in ("resample_from_p", "no_q_update", "shared_uniform")

    def run(tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams,
            gen: torch.Generator) -> list[int]:
        probs = params.probs(target_logits)
        node, out = 0, []
        while True:
            p = probs[node]
            q = None if tree.draft_probs is None else tree.draft_probs[node].clone()
            accepted = -1
            shared_u = float(torch.rand((), generator=gen))
            for child in tree.children[node]:
                x = int(tree.tokens[child])
                qx = 1.0 if q is None else float(q[x])
                u = shared_u if mistake == "shared_uniform" else float(torch.rand((), generator=gen))
                if u * qx < float(p[x]):
                    accepted = child
                    break
                if mistake == "resample_from_p":
                    continue
                if q is None:
                    p = p.clone()
                    p[x] = 0.0
                else:
                    p = (p - q).clamp(min=0.0)
                    if mistake != "no_q_update":
                        q[x] = 0.0
                        q = q / q.sum()
                total = p.sum()
                p = p / total if total > 0 else probs[node]
            if accepted < 0:
                out.append(int(sample(p, gen)))
                return out
            node = accepted
            out.append(int(tree.tokens[node]))

    return run


# --- tests --------------------------------------------------------------------------------------


def test_draft_and_target_really_differ():
    # Total variation between the processed target and draft rows: large, so mistakes are visible,
    # but far from disjoint, so drafts do get accepted.
    for params in (T1, T07_K3, P08):
        tv = 0.5 * (params.probs(TARGET) - params.probs(DRAFT)).abs().sum(-1)
        assert 0.2 < float(tv.mean()) < 0.7, (params, tv)


CASES = [
    pytest.param(T1, 1, 3, False, id="t1-chain3"),
    pytest.param(T1, 3, 2, False, id="t1-tree3x2"),
    pytest.param(T07_K3, 1, 2, False, id="t0.7-topk3-chain2"),
    pytest.param(T07_K3, 2, 2, False, id="t0.7-topk3-tree2x2"),
    pytest.param(P08, 1, 3, False, id="topp0.8-chain3"),
    pytest.param(P08, 3, 2, False, id="topp0.8-tree3x2"),
    pytest.param(T1, 1, 3, True, id="t1-deterministic-chain3"),
    pytest.param(T1, 3, 2, True, id="t1-deterministic-tree3x2"),
    pytest.param(T07_K3, 2, 2, True, id="t0.7-topk3-deterministic-tree2x2"),
]


@pytest.mark.parametrize(("params", "width", "depth", "deterministic"), CASES)
def test_every_case_both_accepts_and_rejects(params, width, depth, deterministic):
    assert 0.1 < accept_rate(params, width, depth, deterministic) < depth - 0.1


@pytest.mark.parametrize(("params", "width", "depth", "deterministic"), CASES)
def test_speculative_sampling_preserves_target_distribution(params, width, depth, deterministic):
    counts = first_two_tokens(real_verifier, params, width, depth, deterministic)
    p_value = chi_square_p(counts, exact_joint(params))
    assert p_value > PASS_P, f"verifier output differs from the target distribution (p={p_value:.2e})"


@pytest.mark.parametrize(
    ("mistake", "params", "width", "depth", "deterministic"),
    [
        pytest.param("resample_from_p", T1, 1, 2, False, id="resample-from-p-chain"),
        pytest.param("resample_from_p", T1, 3, 2, True, id="resample-from-p-deterministic-tree"),
        pytest.param("no_q_update", T1, 3, 2, False, id="no-q-update-tree"),
        pytest.param("shared_uniform", T1, 3, 2, True, id="shared-uniform-deterministic-tree"),
    ],
)
def test_negative_control_flawed_verifier_is_rejected(mistake, params, width, depth, deterministic):
    counts = first_two_tokens(flawed_verifier(mistake), params, width, depth, deterministic)
    p_value = chi_square_p(counts, exact_joint(params))
    assert p_value < REJECT_P, f"the test cannot tell a flawed verifier from an exact one (p={p_value:.2e})"


@pytest.mark.parametrize("params", [T1, T07_K3], ids=["t1", "t0.7-topk3"])
def test_grafted_lookup_paths_keep_sampling_exact(params):
    """A deterministic top-2 tree with prompt-lookup paths grafted on: one through an existing node
    (adding a new grandchild), one as a new root child. Still one-hot drafts, still exact."""
    base = draft_tree(params, 2, 2, torch.Generator().manual_seed(0), deterministic=True)
    first = base.children[0][0]
    kids = [int(base.tokens[c]) for c in base.children[0]]
    grandkids = [int(base.tokens[c]) for c in base.children[first]]
    new_root_child = next(t for t in range(VOCAB) if t not in kids)
    new_grandchild = next(t for t in range(VOCAB) if t not in grandkids)
    tree = base.graft([[kids[0], new_grandchild], [new_root_child, kids[0]]], max_new_nodes=4)
    assert tree.size == base.size + 3
    counts = first_two_tokens(real_verifier, params, 2, 2, deterministic=True, tree=tree)
    p_value = chi_square_p(counts, exact_joint(params))
    assert p_value > PASS_P, f"verifier output differs from the target distribution (p={p_value:.2e})"


@pytest.mark.parametrize("params", [T1, T07_K3], ids=["t1", "t0.7-topk3"])
def test_a_tree_with_extra_rows_verifies_as_its_nodes_alone(params):
    """Lookahead decoding's shape: a trie of deterministic n-grams below the root, with a Jacobi window's extra rows
    (`extra_rows.py`) beside it. The verifier reads the nodes only; the law stays the target's."""
    n_grams = [[1, 2], [1, 4], [3, 0]]
    tree = DraftTree.root_only(ROOT).graft(n_grams, max_new_nodes=6)
    window = ExtraRows(tokens=torch.tensor([5, 5, 1]), depths=torch.tensor([1, 2, 3]),
                       sees=torch.ones(3, 3, dtype=torch.bool).tril())
    tree = DraftTree(tokens=tree.tokens, parents=tree.parents, extra=window)
    assert tree.size == 6 and tree.input_size == 9
    counts = first_two_tokens(real_verifier, params, 2, 2, deterministic=True, tree=tree)
    p_value = chi_square_p(counts, exact_joint(params))
    assert p_value > PASS_P, f"verifier output differs from the target distribution (p={p_value:.2e})"


def greedy_chain(root: int, length: int) -> list[int]:
    out, tok = [], root
    for _ in range(length):
        tok = int(TARGET[tok].argmax())
        out.append(tok)
    return out


@pytest.mark.parametrize("deterministic", [False, True])
def test_temperature_zero_commits_the_argmax_chain(deterministic):
    gen = torch.Generator().manual_seed(5)
    accepted = []
    for step in range(300):
        # A fresh draft near the target each step, so argmax prefixes of every length get drafted.
        close = TARGET + torch.randn(VOCAB, VOCAB, generator=gen)
        q_table = T1.probs(close)
        root = step % VOCAB
        tokens, parents, frontier = [root], [-1], [0]
        for _ in range(3):
            nxt = []
            for node in frontier:
                row = close[tokens[node]]
                kids = (torch.topk(row, 2).indices if deterministic
                        else torch.multinomial(q_table[tokens[node]], 2, replacement=False, generator=gen)).tolist()
                for kid in kids:
                    tokens.append(kid)
                    parents.append(node)
                    nxt.append(len(tokens) - 1)
            frontier = nxt
        tree = DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents),
                         draft_probs=None if deterministic else q_table[tokens])
        result = verify(tree, TARGET[tree.tokens], SamplingParams(temperature=0.0), gen)
        assert result.tokens.tolist() == greedy_chain(root, result.num_accepted + 1)
        # Nothing longer was available: no child of the last accepted node is the next argmax token.
        last = int(result.path[-1])
        assert all(tokens[c] != int(result.tokens[-1]) for c in tree.children[last])
        accepted.append(result.num_accepted)
    assert set(accepted) == {0, 1, 2, 3}
