"""Suffix decoding: the suffix tree counts every window of its texts (grown token by token, whole texts removed), drafts
follow those counts, the cache of answers keeps within its bound, a repeated request drafts its whole answer, greedy
and sampled output stay exact, and an isolated row never drafts another request's text."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from specheads.inference.engine.engine import Engine
from specheads.inference.engine.proposer import AutoregressiveProposer, ProposalContext
from specheads.inference.engine.sampling import SamplingParams
from specheads.inference.methods import METHODS, make_proposer
from specheads.inference.methods.options import SuffixConfig
from specheads.inference.proposers.node_budget import WithNodeBudget
from specheads.inference.proposers.suffix import SuffixProposer
from specheads.inference.proposers.suffix_cache import SuffixCache
from specheads.inference.proposers.suffix_tree import DraftLimits, SuffixTree
from tests.conftest import repetitive_prompt
from tests.drafters import (
    bigram_target,
    check_engine_keeps_the_law,
)

LIMITS = DraftLimits(max_nodes=16, max_depth=8, factor=1.0, min_prob=0.0, max_match=16)


def windows(texts: list[list[int]], depth: int) -> Counter:
    """Every substring of 1..depth tokens of `texts`, with how often it occurs."""
    return Counter(tuple(t[i:j]) for t in texts for i in range(len(t))
                   for j in range(i + 1, min(i + depth, len(t)) + 1))


def tree_counts(tree: SuffixTree) -> Counter:
    counts, stack = Counter(), [(tree.root, ())]
    while stack:
        node, path = stack.pop()
        for kid in node.children():
            counts[path + (kid.token,)] = kid.count
            stack.append((kid, path + (kid.token,)))
    return counts


def test_the_tree_counts_every_window_as_texts_grow_and_go():
    rng = random.Random(0)
    tree, texts = SuffixTree(depth=5), {}
    for seq in range(6):  # small vocabulary: windows repeat within and across texts
        texts[seq] = [rng.randrange(4) for _ in range(rng.randrange(5, 40))]
        pieces = texts[seq][:]
        while pieces:  # appended in chunks of any size, as committed tokens arrive
            cut = rng.randrange(1, 6)
            tree.extend(seq, pieces[:cut])
            pieces = pieces[cut:]
        tree.close(seq)
    assert tree_counts(tree) == windows(list(texts.values()), 5)
    for seq in (1, 4, 0):
        tree.remove(seq)
        del texts[seq]
        assert tree_counts(tree) == windows(list(texts.values()), 5)
        assert tree.nodes == 1 + len(windows(list(texts.values()), 5))  # no node outlives its windows
    for seq in list(texts):
        tree.remove(seq)
    assert tree.nodes == 1 and tree.root.kids is None


def test_drafts_follow_how_often_each_continuation_followed():
    tree = SuffixTree(depth=8)
    tree.extend(0, [1, 2, 3, 4, 9, 1, 2, 3, 4, 8, 1, 2, 3, 5, 7])
    wide = DraftLimits(max_nodes=16, max_depth=8, factor=4.0, min_prob=0.0, max_match=16)
    draft = tree.draft([6, 1, 2, 3], wide)
    assert draft.match == 3  # "1 2 3"; "6 1 2 3" never occurred
    # "1 2 3" went on to 4 twice, to 5 once; "1 2 3 4" to 9 once, to 8 once
    assert draft.tokens[:4] == [4, 5, 9, 8] and draft.parents[:4] == [-1, -1, 0, 0]
    assert draft.probs[:4] == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    # every continuation the depth-8 tree holds below "1 2 3" (12 allowed: 4 per matched token), best first
    assert len(draft.tokens) == 11 and draft.probs == sorted(draft.probs, reverse=True)
    paths, probs = draft.paths()
    assert {p[0] for p in paths} == {4, 5} and all(p == sorted(p, reverse=True) for p in probs)
    # Adaptive size: one node per matched token (factor 1); a draft stops at max_depth levels.
    assert tree.draft([6, 1, 2, 3], LIMITS).tokens == [4, 5, 9]
    assert tree.draft([0, 3], LIMITS).tokens == [4]
    short = tree.draft([6, 1, 2, 3], DraftLimits(max_nodes=16, max_depth=1, factor=4.0, min_prob=0.0, max_match=16))
    assert short.tokens == [4, 5] and short.parents == [-1, -1]
    assert tree.draft([0, 0], LIMITS).tokens == []  # nothing matched: nothing drafted
    assert tree.draft([6, 1, 2, 3], DraftLimits(max_nodes=16, max_depth=8, factor=4.0, min_prob=0.5,
                                                max_match=16)).tokens == [4]


def test_the_cache_stays_within_its_bound_and_evicts_the_least_recently_used():
    rng = random.Random(1)
    cache = SuffixCache(max_tokens=300, depth=12)
    for _ in range(400):  # a long load of answers of every length
        cache.add([rng.randrange(50) for _ in range(rng.randrange(1, 80))])
        assert cache.tokens <= 300 and cache.tree.nodes <= 1 + 12 * 300
        assert cache.tokens == sum(len(cache.tree.tokens(s)) for s in cache._recent)
    held = [cache.tree.tokens(s) for s in cache._recent]
    assert tree_counts(cache.tree) == windows(held, 12)  # evicted answers left nothing behind
    cache.add(list(range(1000)))  # longer than the bound: its last tokens stay, alone
    assert cache.tokens == 300 and len(cache) == 1 and tree_counts(cache.tree) == windows([list(range(700, 1000))], 12)

    lru = SuffixCache(max_tokens=30, depth=6)
    for start in (100, 200, 300):
        lru.add(list(range(start, start + 10)))
    assert lru.draft([100, 101], LIMITS).tokens[:2] == [102, 103]  # the first answer was used just now
    lru.add(list(range(400, 410)))  # evicts the least recently used: the second
    assert lru.draft([200, 201], LIMITS).tokens == [] and lru.draft([100, 101], LIMITS).tokens[:1] == [102]


def suffix(target, **options):
    return make_proposer("suffix", target, METHODS.get("suffix").make_options(options), None)


def test_a_repeated_request_drafts_its_whole_answer(target):
    prompt = repetitive_prompt(24, seed=5)
    want = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=40).output_ids
    proposer = suffix(target)
    assert isinstance(proposer, WithNodeBudget) and isinstance(proposer.inner, SuffixProposer)
    engine = Engine(target, proposer)
    first = engine.generate(prompt, max_new_tokens=40)
    again = engine.generate(prompt, max_new_tokens=40)
    assert first.output_ids == again.output_ids == want
    cache = proposer.inner.cache
    assert len(cache) == 2 and cache.tree.tokens(0) == prompt[-16:] + want  # answers led by their prompt's end
    # 40 tokens in 6 steps: the prefill's token, then 8 drafted + 1 per step (the last steps cut by the length)
    assert again.stats.steps <= 6 and again.stats.tau > 6, again.stats
    assert again.stats.tau > first.stats.tau


def test_rows_share_one_cache_and_decode_exactly(target):
    prompts = [repetitive_prompt(n, seed) for seed, n in ((1, 20), (2, 12), (3, 28))]
    want = [Engine(target, AutoregressiveProposer()).generate(p, max_new_tokens=24).output_ids for p in prompts]
    proposer = suffix(target, node_budget="fixed")
    engine = Engine(target, proposer, max_rows=3)
    for _ in range(2):  # the second round drafts from the first's answers
        seqs = [engine.add(p, max_new_tokens=24) for p in prompts]
        while any(not s.done for s in seqs):
            engine.step()
        assert [s.output for s in seqs] == want
    assert len(proposer.cache) == 6 and proposer.fork().cache is proposer.cache
    assert min(s.stats.tau for s in seqs) > 4, [s.stats.tau for s in seqs]


class Recording(SuffixProposer):
    """Records, per draft, the tokens the row's own text held and the tokens drafted."""

    def __init__(self, config: SuffixConfig) -> None:
        super().__init__(config)
        self.log: list[tuple[set[int], list[int]]] = []

    def propose(self, ctx: ProposalContext):
        tree = super().propose(ctx)
        self.log.append((set(ctx.tokens.tolist()), tree.tokens[1:].tolist()))
        return tree


@pytest.mark.parametrize("isolate", [False, True])
def test_an_isolated_row_never_drafts_another_requests_text(target, isolate):
    proposer = Recording(SuffixConfig(isolate=isolate))
    engine = Engine(target, proposer)
    prompt = repetitive_prompt(24, seed=3)
    first = engine.generate(prompt, max_new_tokens=40)
    proposer.log.clear()
    again = engine.generate(prompt, max_new_tokens=40)
    assert again.output_ids == first.output_ids
    foreign = [tok for own, drafted in proposer.log for tok in drafted if tok not in own]
    if isolate:
        assert proposer.cache is None and proposer.fork().cache is None and foreign == []
    else:  # the control: the same requests without isolation draft the first answer's tokens ahead of time
        assert foreign and again.stats.tau > first.stats.tau


def test_plain_steps_between_drafts_reach_the_requests_tree():
    """Steps the engine decodes plainly never ask the proposer: the next draft catches up from the context."""
    proposer = SuffixProposer(SuffixConfig(cache_tokens=0))
    text = [5, 6, 7, 8, 9, 1, 2, 3]

    def ctx(n: int) -> ProposalContext:
        return ProposalContext(tokens=torch.tensor(text[:n]), num_prompt_tokens=4, max_depth=8,
                               sampling=SamplingParams(), generator=None)

    proposer.start(ctx(4), None)
    text += [5, 6, 7]  # committed by plain steps: "5 6 7" was followed by 8 9 1 ...
    tree = proposer.propose(ctx(len(text)))
    assert tree.tokens[1:4].tolist() == [8, 9, 1] and tree.accept_probs is not None


@pytest.mark.usefixtures("one_thread")
def test_sampled_rows_keep_the_targets_law():
    """Chi-square of the first two sampled tokens against the target's law (tests/drafters.py), with drafts from the
    request and from every earlier generation's answer; a verifier that keeps a rejected draft fails it."""
    target = bigram_target()
    check_engine_keeps_the_law(Engine(target, suffix(target, node_budget="fixed"), max_rows=4), target)
