"""Lookahead decoding: the n-gram pool, the Jacobi window, the extra rows' mask in the verify forward (they can never
change what is committed), and exactness of the method under greedy decoding, in batches and under sampling."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specheads.inference import Engine
from specheads.inference.engine.batch_cache import BatchKVCache, batch_tree_mask
from specheads.inference.engine.extra_rows import ExtraRows
from specheads.inference.engine.fallback import check_proposal
from specheads.inference.engine.forward import batch_forward
from specheads.inference.engine.lean_forward import target_forward
from specheads.inference.engine.proposer import AutoregressiveProposer
from specheads.inference.engine.tree import DraftTree
from specheads.inference.methods import METHODS, make_proposer
from specheads.inference.methods.options import LookaheadConfig
from specheads.inference.proposers.jacobi_window import JacobiWindow
from specheads.inference.proposers.lookahead import LookaheadProposer
from specheads.inference.proposers.ngram_pool import NgramPool
from specheads.inference.proposers.verify_cost import VerifyCost, VerifyCosts
from tests.conftest import TINY_VOCAB, repetitive_prompt, start_proposer, tiny_model
from tests.drafters import bigram_target, check_engine_keeps_the_law

# --- the pool -------------------------------------------------------------------------------------------------------


def test_pool_keeps_the_most_recent_ngrams_per_first_token():
    pool = NgramPool(size=3, per_key=2)
    pool.add([5, 6, 7])
    pool.add([5, 8, 9])
    pool.add([4, 1, 2])
    assert pool.continuations(5, 3) == [(8, 9), (6, 7)]
    pool.add([5, 6, 7])  # seen again: the most recent
    assert pool.continuations(5, 3) == [(6, 7), (8, 9)]
    pool.add([5, 1, 1])  # a third under 5: the oldest, (8, 9), goes
    assert pool.continuations(5, 3) == [(1, 1), (6, 7)] and pool.continuations(5, 1) == [(1, 1)]
    assert pool.continuations(4, 3) == [(1, 2)] and pool.continuations(9, 3) == [] and len(pool) == 3


def test_pool_from_text_holds_every_ngram_later_ones_first():
    pool = NgramPool(size=3, per_key=4)
    pool.add_text([1, 2, 3, 1, 2, 4, 2])
    assert pool.continuations(1, 4) == [(2, 4), (2, 3)]
    assert pool.continuations(2, 4) == [(4, 2), (3, 1)]
    assert pool.continuations(4, 4) == []  # "4 2" is too short to be a 3-gram


# --- the Jacobi window ----------------------------------------------------------------------------------------------


def chain_of(window: JacobiWindow, cell: tuple[int, int]) -> set[tuple[int, int]]:
    """The cells `cell` should see: level 0's columns 1..j, then its column's cells of levels 1..l."""
    lv, j = cell
    return {(0, c) for c in range(1, j + 1)} | {(k, j) for k in range(1, lv + 1)}


def test_window_rows_are_chains_of_consecutive_positions():
    window = JacobiWindow(width=3, levels=3, source=[7])
    rows = window.rows(root=50, max_depth=10)
    assert window.cells == [(0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert rows.size == LookaheadConfig(window=3, ngram=4).window_rows == 8
    assert rows.depths.tolist() == [lv + j for lv, j in window.cells]
    for i, cell in enumerate(window.cells):
        seen = {window.cells[k] for k in rows.sees[i].nonzero().flatten().tolist()}
        assert seen == chain_of(window, cell), cell
        # every cell it sees is one position before another it sees (or the root): a chain from the root
        assert sorted(window.cells[k][0] + window.cells[k][1] for k in rows.sees[i].nonzero().flatten().tolist()) \
            == list(range(1, cell[0] + cell[1] + 1))
    assert window.guesses[0][0] == 50 and rows.tokens.tolist() == [7] * 8  # filled from the source
    clipped = window.rows(root=50, max_depth=2)  # only the cells at depth <= 2, in the same order
    assert clipped.depths.tolist() == [1, 2, 1, 2, 2] and window.num_sent == 5
    assert window.rows(root=50, max_depth=0) is None and window.num_sent == 0


def test_window_advances_one_iteration_and_hands_out_column_trajectories():
    window = JacobiWindow(width=3, levels=2, source=[90])
    window.guesses = [[50, 11, 12], [21, 22, 23]]  # level 0 (column 0: the root), level 1
    window.rows(root=50, max_depth=10)  # cells (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)
    ngrams = window.advance(1, [0, 0, 31, 32, 33])  # outputs at the last level make the new one
    assert ngrams == [[50, 21, 31], [11, 22, 32], [12, 23, 33]]
    assert window.guesses == [[21, 22, 23], [31, 32, 33]]  # one level down; 21 sits where the next root is
    # three tokens committed: the window also moves two columns left, so each guess keeps its position
    window.rows(root=60, max_depth=10)
    ngrams = window.advance(3, [0, 0, 41, 42, 43])
    assert ngrams == [[60, 31, 41], [22, 32, 42], [23, 33, 43]]
    assert window.guesses == [[33, 90, 90], [43, 90, 90]]  # columns from the right are filled from the source


def test_window_without_outputs_still_moves_with_the_text():
    window = JacobiWindow(width=2, levels=2, source=[90])
    window.guesses = [[50, 11], [21, 22]]
    assert window.advance(1, None) == []  # a plain step: nothing was fed
    assert window.guesses == [[21, 22], [90, 90]]
    window.rows(root=21, max_depth=1)  # cells (0, 1) and (1, 0) only: (1, 1) sits at depth 2
    assert window.advance(1, [5, 6]) == [[21, 90, 6]]  # only column 0's last-level cell was fed
    assert window.guesses == [[90, 90], [6, 90]]


# --- the extra rows in the verify forward ---------------------------------------------------------------------------


def test_nodes_never_see_extra_rows_and_extra_rows_see_only_the_root_and_their_chain():
    tree = DraftTree(tokens=torch.tensor([1, 2, 3, 4]), parents=torch.tensor([-1, 0, 0, 1]))
    extra = ExtraRows(tokens=torch.tensor([7, 8, 9]), depths=torch.tensor([1, 2, 2]),
                      sees=torch.tensor([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool))
    rows = DraftTree(tokens=tree.tokens, parents=tree.parents, extra=extra)
    assert (rows.size, rows.input_size, rows.num_drafted) == (4, 7, 3)
    assert rows.input_tokens.tolist() == [1, 2, 3, 4, 7, 8, 9] and rows.input_depths.tolist() == [0, 1, 1, 2, 1, 2, 2]
    visible = rows.input_visible
    assert torch.equal(visible[:4, :4], tree.ancestors) and not visible[:4, 4:].any()
    assert visible[4:].int().tolist() == [[1, 0, 0, 0, 1, 0, 0], [1, 0, 0, 0, 1, 1, 0], [1, 0, 0, 0, 0, 0, 1]]
    assert not rows.is_plain_chain and DraftTree.chain(torch.tensor([1, 2])).is_plain_chain
    # the additive mask over a 5-token prefix: nodes as before, extra rows at the prefix, the root and their chain
    mask = batch_tree_mask([rows], [5], torch.float32, torch.device("cpu"))[0, 0] == 0
    assert mask[:4, :5].all() and torch.equal(mask[:4, 5:9], tree.ancestors) and not mask[:4, 9:].any()
    assert mask[4:, :5].all() and torch.equal(mask[4:, 5:], visible[4:])


def test_tree_operations_keep_the_extra_rows_and_truncation_cuts_them_by_depth():
    extra = ExtraRows(tokens=torch.tensor([7, 8, 9]), depths=torch.tensor([1, 2, 3]),
                      sees=torch.ones(3, 3, dtype=torch.bool).tril())
    tree = DraftTree(tokens=torch.tensor([1, 2, 3]), parents=torch.tensor([-1, 0, 1]), extra=extra)
    assert tree.graft([[5, 6]], 4).extra is extra and tree.subtree(torch.tensor([0, 1])).extra is extra
    cut = tree.truncated(2)
    assert cut.size == 3 and cut.extra.depths.tolist() == [1, 2] and torch.equal(cut.extra.sees, extra.sees[:2, :2])
    assert tree.truncated(1).size == 2 and tree.truncated(1).extra.size == 1
    assert tree.truncated(0).extra is None
    with pytest.raises(AssertionError, match="only shallower rows"):
        ExtraRows(tokens=torch.tensor([7, 8]), depths=torch.tensor([2, 2]),
                  sees=torch.ones(2, 2, dtype=torch.bool).tril())


def test_a_proposal_with_extra_tokens_outside_the_vocabulary_is_refused():
    from specheads.inference.engine.proposer import ProposalContext
    from specheads.inference.engine.sampling import SamplingParams

    ctx = ProposalContext(tokens=torch.tensor([3, 4]), num_prompt_tokens=2, max_depth=4, sampling=SamplingParams(),
                          generator=None)
    extra = ExtraRows(tokens=torch.tensor([TINY_VOCAB]), depths=torch.tensor([1]), sees=torch.ones(1, 1, dtype=bool))
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        check_proposal(DraftTree(tokens=torch.tensor([4]), parents=torch.tensor([-1]), extra=extra), ctx, TINY_VOCAB)


@pytest.mark.parametrize("step", ["hf", "lean"])
def test_poisoned_extra_rows_change_neither_the_nodes_logits_nor_the_committed_cache(target, step):
    """Two rows verify the same trees, one with extra rows of arbitrary tokens (deeper than the tree, seeing each
    other): the nodes' logits agree, and after committing each row's path its cache holds the same entries."""
    lean = target_forward(target, step)
    prompts = [repetitive_prompt(12, seed=1), repetitive_prompt(9, seed=2)]
    trees = [DraftTree(tokens=torch.tensor([p[-1], 5, 6, 7]), parents=torch.tensor([-1, 0, 0, 1])) for p in prompts]
    g = torch.Generator().manual_seed(0)
    poison = ExtraRows(tokens=torch.randint(0, TINY_VOCAB, (6,), generator=g), depths=torch.arange(1, 7),
                       sees=torch.ones(6, 6, dtype=torch.bool).tril())
    poisoned = [trees[0], DraftTree(tokens=trees[1].tokens, parents=trees[1].parents, extra=poison)]

    def run(batch):
        cache = BatchKVCache(target.config, rows=2, capacity=8)
        for p in prompts:
            row = cache.add_row()
            cache.window(row, 1)
            batch_forward(target, cache, [DraftTree.chain(torch.tensor(p[:-1]))], row, lean=lean)
            cache.commit(row, torch.arange(len(p) - 1))
        out = batch_forward(target, cache, batch, 0, lean=lean)
        for row in range(2):
            cache.commit(row, torch.tensor([0, 1, 3]))
        return out.logits, cache

    clean_logits, clean_cache = run(trees)
    poisoned_logits, poisoned_cache = run(poisoned)
    torch.testing.assert_close(poisoned_logits[:, :4], clean_logits[:, :4], atol=1e-5, rtol=1e-5)
    assert poisoned_cache.lengths == clean_cache.lengths
    for clean, dirty in zip(clean_cache.layers, poisoned_cache.layers):
        for row, length in enumerate(clean_cache.lengths):
            torch.testing.assert_close(dirty._kbuf[row, :, :length], clean._kbuf[row, :, :length], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(dirty._vbuf[row, :, :length], clean._vbuf[row, :, :length], atol=1e-5, rtol=1e-5)


class PoisonedLookahead(LookaheadProposer):
    """Lookahead decoding whose window rows carry random tokens every step (what the window holds must never matter)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(LookaheadConfig(window=4, ngram=4, lazy_window=False))
        self.rng = torch.Generator().manual_seed(seed)
        self.fed = 0

    def propose(self, ctx):
        tree = super().propose(ctx)
        if tree.extra is None:
            return tree
        extra = tree.extra
        self.fed += extra.size
        noise = ExtraRows(tokens=torch.randint(0, TINY_VOCAB, (extra.size,), generator=self.rng), depths=extra.depths,
                          sees=extra.sees)
        return DraftTree(tokens=tree.tokens, parents=tree.parents, extra=noise)


@pytest.mark.parametrize("step", ["hf", "lean"])
def test_poisoned_window_rows_leave_greedy_output_unchanged(target, step):
    prompt = repetitive_prompt(seed=3)
    plain = Engine(target, AutoregressiveProposer(), step=step).generate(prompt, max_new_tokens=30)
    proposer = PoisonedLookahead()
    res = Engine(target, proposer, step=step).generate(prompt, max_new_tokens=30)
    assert res.output_ids == plain.output_ids
    assert proposer.fed > 100 and res.stats.drafted > 0


def test_the_compiled_forward_masks_the_extra_rows_like_the_eager_one():
    """`--compile` with lookahead: random window rows every step go through the compiled graph, whose mask keeps
    them out of every node as the eager forward's does; a second prompt (other widths) compiles nothing new."""
    from torch._dynamo.utils import counters

    model = tiny_model("qwen3", layers=2)  # the compiled stack is one graph of every layer: two compile in half time
    prompts = [repetitive_prompt(seed=3), repetitive_prompt(length=15, seed=4)]
    plain = [Engine(model, AutoregressiveProposer(), step="hf").generate(p, max_new_tokens=30).output_ids
             for p in prompts]
    proposer = PoisonedLookahead()
    engine = Engine(model, proposer, step="lean", compile=True)
    assert engine.lean.compiled
    first = engine.generate(prompts[0], max_new_tokens=30)
    assert first.output_ids == plain[0] and proposer.fed > 100
    graphs = counters["stats"]["unique_graphs"]
    assert engine.generate(prompts[1], max_new_tokens=30).output_ids == plain[1]
    assert counters["stats"]["unique_graphs"] == graphs


# --- the method -----------------------------------------------------------------------------------------------------


def test_the_window_runs_in_the_verify_forward_and_fills_the_pool(target):
    options = METHODS.get("lookahead").make_options({"prompt_pool": 0, "lazy_window": 0})
    proposer = make_proposer("lookahead", target, options, None)
    prompt = repetitive_prompt(seed=1)
    ctx = start_proposer(proposer, target, prompt, max_depth=20)
    assert len(proposer.pool) == 0  # no prompt n-grams asked for
    tree = proposer.propose(ctx)
    assert tree.size == 1 and tree.extra.size == LookaheadConfig().window_rows
    res = Engine(target, proposer).generate(prompt, max_new_tokens=20)
    assert len(proposer.pool) > 0 and res.stats.drafted > 0  # the window's trajectories were drafted


def test_a_lazy_window_rides_along_only_with_drafts(target):
    proposer = LookaheadProposer()  # lazy by default
    prompt = [10, 11, 12, 40, 10]
    ctx = start_proposer(proposer, target, prompt)
    tree = proposer.propose(ctx)  # root 10: the prompt's "10 11 12" is drafted, and the window runs beside it
    assert tree.tokens.tolist() == [10, 11, 12] and tree.extra.size == LookaheadConfig().window_rows
    plain = proposer.propose(replace(ctx, tokens=torch.tensor(prompt + [50])))  # no n-gram starts with 50
    assert plain.size == 1 and plain.extra is None


def test_a_lazy_window_runs_only_where_the_drafts_pay_for_the_wide_forward(target):
    steep = VerifyCosts(fixed=VerifyCost(nodes=(1, 2), seconds=(1.0, 3.0)))  # every extra row: two more steps
    flat = VerifyCosts(fixed=VerifyCost(nodes=(1, 32), seconds=(1.0, 1.1)))
    prompt = [10, 11, 12, 40, 10]
    for costs, wide in ((steep, False), (flat, True)):
        proposer = LookaheadProposer(LookaheadConfig(), costs)
        tree = proposer.propose(start_proposer(proposer, target, prompt))
        assert (tree.size > 1) == wide and (tree.extra is not None) == wide
        assert proposer._proposed == [[11, 12]]  # looked up either way, so its hit rate is measured either way


def test_near_the_end_the_window_is_cut_to_the_rows_the_sequence_may_reach(target):
    proposer = LookaheadProposer(LookaheadConfig(window=4, ngram=3, lazy_window=False))
    ctx = start_proposer(proposer, target, repetitive_prompt(seed=1), max_depth=2)
    tree = proposer.propose(ctx)
    assert tree.max_depth <= 2 and int(tree.extra.depths.max()) == 2
    assert [len(Engine(target, LookaheadProposer()).generate(repetitive_prompt(seed=s), max_new_tokens=m).output_ids)
            for s, m in ((1, 1), (2, 2), (3, 3))] == [1, 2, 3]


def test_rows_decode_lookahead_greedily_as_each_would_alone():
    target = tiny_model("llama")
    prompts = [repetitive_prompt(length, seed) for seed, length in enumerate((24, 9, 17, 30), start=1)]
    plain = [Engine(target, AutoregressiveProposer()).generate(p, max_new_tokens=20).output_ids for p in prompts]
    engine = Engine(target, LookaheadProposer(LookaheadConfig(lazy_window=False)), max_rows=3)
    seqs = [engine.add(p, max_new_tokens=20) for p in prompts]
    while any(not s.done for s in seqs):
        engine.step()
    assert [s.output for s in seqs] == plain
    assert all(s.stats.drafted > 0 for s in seqs)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("rows", [1, 4])
def test_sampled_lookahead_keeps_the_targets_law(rows):
    """The chi-square check of tests/drafters.py (the first two sampled tokens against the target's law, and a
    verifier that keeps a rejected draft caught by it), with the window in every verify forward."""
    target = bigram_target()
    proposer = make_proposer("lookahead", target, METHODS.get("lookahead").make_options({"lazy_window": 0}), None)
    check_engine_keeps_the_law(Engine(target, proposer, max_rows=rows), target, label=f"lookahead x{rows}")


def test_sliding_window_layers_window_the_extra_rows_too():
    """A model whose layers attend within a few tokens: the extra rows' masks are windowed at their own positions."""
    target = tiny_model("mistral-window")
    prompt = repetitive_prompt(seed=2)
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=24)
    proposer = PoisonedLookahead()
    res = Engine(target, proposer).generate(prompt, max_new_tokens=24)
    assert res.output_ids == plain.output_ids and proposer.fed > 0
