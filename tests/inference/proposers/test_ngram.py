from __future__ import annotations

import torch

from specheads.inference.engine.proposer import ProposalContext
from specheads.inference.engine.sampling import SamplingParams
from specheads.inference.engine.tree import DraftTree
from specheads.inference.proposers.ngram import NgramConfig, NgramProposer, find_matches


def ctx(tokens: list[int], max_depth: int = 10) -> ProposalContext:
    return ProposalContext(tokens=torch.tensor(tokens), num_prompt_tokens=len(tokens), max_depth=max_depth,
                           sampling=SamplingParams(), generator=None)


def test_continuations_longest_ngram_and_most_recent_first():
    #          0  1  2  3  4  5  6  7  8  9 10 11 12
    tokens = [1, 2, 3, 9, 9, 5, 2, 3, 7, 8, 4, 2, 3]
    conts = [c for _, c in find_matches(torch.tensor(tokens),
                                        NgramConfig(max_ngram=2, min_ngram=1, num_candidates=3, depth=2), 2)]
    # "2 3" occurs at 1 and 6: most recent first -> [7, 8] then [9, 9]; then the 1-gram "3" adds nothing new.
    assert conts == [[7, 8], [9, 9]]


def test_no_match_gives_a_plain_step():
    tree = NgramProposer().propose(ctx([1, 2, 3, 4, 5]))
    assert tree.size == 1 and int(tree.tokens[0]) == 5


def test_trie_merges_shared_prefixes_and_respects_budget():
    tree = DraftTree.root_only(7).graft([[1, 2, 3], [1, 2, 4], [5]], max_new_nodes=10)
    assert tree.tokens.tolist() == [7, 1, 2, 3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 2, 0]
    small = DraftTree.root_only(7).graft([[1, 2, 3], [1, 2, 4], [5]], max_new_nodes=3)
    assert small.num_drafted == 3


def test_depth_capped_by_context():
    tokens = [1, 2, 3, 4, 1, 2]
    tree = NgramProposer(NgramConfig(depth=5)).propose(ctx(tokens, max_depth=1))
    assert tree.max_depth == 1 and tree.tokens.tolist() == [2, 3]
