"""The verify-cost curve and the per-step node budget built on it: interpolation, caching, which nodes a
budget keeps, calibration, lookup hit rates, and greedy output still equal to plain greedy."""

from __future__ import annotations

import json

import pytest
import torch

import specheads.inference.proposers.verify_cost as verify_cost_mod
from specheads.inference import Engine
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult
from specheads.inference.proposers import AutoregressiveProposer
from specheads.inference.proposers.eagle import EagleProposer
from specheads.inference.proposers.lookup import WithPromptLookup
from specheads.inference.proposers.ngram import HitRates
from specheads.inference.proposers.node_budget import Calibration, NodeBudget, WithNodeBudget
from specheads.inference.proposers.verify_cost import (
    VerifyCost,
    VerifyCosts,
    measure_verify_cost,
    verify_cost,
)
from tests.conftest import random_eagle_head, repetitive_prompt, start_proposer, tiny_model

FLAT = VerifyCost(nodes=(1, 64), seconds=(0.01, 0.01))  # a GPU-like curve: any tree costs one step
STEEP = VerifyCost(nodes=(1, 2, 4, 8), seconds=(0.01, 0.013, 0.016, 0.024))  # a CPU-like one: +0.15-0.2 step a node


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def star(probs: list[float], parents: list[int] | None = None) -> DraftTree:
    n = len(probs) + 1
    return DraftTree(tokens=torch.arange(10, 10 + n), parents=torch.tensor(parents or [-1] + [0] * (n - 1)),
                     accept_probs=torch.tensor([1.0, *probs], dtype=torch.float64))


def test_relative_cost_interpolates_and_extends_the_last_segment():
    assert STEEP.relative(1) == 1.0
    assert STEEP.relative(3) == pytest.approx(1.45)
    assert STEEP.relative(6) == pytest.approx(2.0)
    assert STEEP.relative(12) == pytest.approx(3.2)  # past 8 nodes: +0.2 per node, as from 4 to 8
    assert FLAT.relative(500) == 1.0
    assert STEEP.table().tolist()[1:4] == pytest.approx([1.0, 1.3, 1.45])


@pytest.mark.parametrize("nodes, seconds", [((2, 4), (1.0, 2.0)), ((1, 4, 2), (1.0, 2.0, 3.0)), ((1, 2), (1.0,)),
                                            ((1, 2), (1.0, 0.0))])
def test_a_bad_curve_is_refused(nodes, seconds):
    with pytest.raises(ValueError, match="verify cost needs"):
        VerifyCost(nodes=nodes, seconds=seconds)


def no_full_measurement(model, sizes=(), **kwargs):
    """A measurement that fails unless it is the cache's quick check, which it answers as a busy machine would (far
    slower than any cached curve), so the cached curve holds (the check itself: test_verify_cost.py)."""
    if tuple(sizes) != verify_cost_mod.CHECK_SIZES:
        pytest.fail("measured again")
    return VerifyCost(nodes=(1, 4), seconds=(10.0, 1000.0))


def test_measured_once_then_read_from_the_cache(target, tmp_path, monkeypatch):
    monkeypatch.setattr(verify_cost_mod, "measure_verify_cost", measure_verify_cost)  # the real one (conftest fixes it)
    first = verify_cost(target, cache_dir=tmp_path, sizes=(1, 2, 4), reps=1, context=16)
    assert first.nodes == (1, 2, 4) and all(s > 0 for s in first.seconds)
    (entry,) = tmp_path.glob("*.json")
    monkeypatch.setattr(verify_cost_mod, "measure_verify_cost", no_full_measurement)
    assert verify_cost(target, cache_dir=tmp_path) == first  # read back (after a quick check), not measured again
    other = tiny_model("llama", layers=2)  # another model has its own entry
    monkeypatch.setattr(verify_cost_mod, "measure_verify_cost", lambda *a, **k: FLAT)
    assert verify_cost(other, cache_dir=tmp_path) == FLAT and len(list(tmp_path.glob("*.json"))) == 2
    entry.write_text("{not json")  # a damaged entry is measured again and replaced
    assert verify_cost(target, cache_dir=tmp_path) == FLAT
    saved = json.loads(entry.read_text())
    assert (saved["nodes"], saved["seconds"]) == ([1, 64], [0.01, 0.01]) and saved["measured_at"] > 0


def test_a_batch_has_its_own_curve_measured_on_padded_rows(target, tmp_path, monkeypatch):
    measured = []

    def measure(model, sizes=(1, 2, 4), **kwargs):
        if tuple(sizes) == verify_cost_mod.CHECK_SIZES:
            return no_full_measurement(model, sizes)
        measured.append(kwargs["batch"])
        return measure_verify_cost(model, sizes=sizes, reps=1, context=16, batch=kwargs["batch"])

    monkeypatch.setattr(verify_cost_mod, "measure_verify_cost", measure)
    costs = VerifyCosts(target, cache_dir=tmp_path)
    four = costs.at(4)
    assert four.nodes == (1, 2, 4) and all(s > 0 for s in four.seconds)
    assert measured == [4] and len(list(tmp_path.glob("*-batch4.json"))) == 1
    three = costs.at(3)  # between the powers of two around it
    assert measured == [4, 2]
    assert three == costs.at(2).blend(four, 0.5)
    assert VerifyCosts(target, cache_dir=tmp_path).at(3) == three and measured == [4, 2]  # read back, not measured


def test_blend_is_linear_at_every_measured_node_count():
    low, high = VerifyCost(nodes=(1, 4), seconds=(1.0, 2.0)), VerifyCost(nodes=(1, 2), seconds=(3.0, 6.0))
    mid = low.blend(high, 0.25)
    assert mid.nodes == (1, 2, 4)
    assert mid.seconds == pytest.approx((1.5, 0.75 * 1 * 4 / 3 + 0.25 * 6.0, 0.75 * 2.0 + 0.25 * 12.0))


def test_measurement_leaves_the_model_usable(target):
    cost = measure_verify_cost(target, sizes=(4, 2), reps=1, context=8)
    assert cost.nodes == (1, 2, 4)


def test_a_flat_curve_keeps_the_whole_tree():
    tree = star([0.5, 0.1, 0.01])
    assert NodeBudget(FLAT, calibrate=False).choose(tree) is tree


def test_a_steep_curve_keeps_only_the_nodes_worth_their_cost():
    tree = star([0.05, 0.9, 0.3, 0.02])
    kept = NodeBudget(STEEP, calibrate=False).choose(tree)
    # 1 node: rate 1; +0.9: 1.9/1.3 = 1.46; +0.3: 2.2/1.45 = 1.52; +0.05: 2.25/1.6 = 1.41
    assert kept.tokens.tolist() == [10, 12, 13] and kept.parents.tolist() == [-1, 0, 0]
    assert kept.accept_probs.tolist() == [1.0, 0.9, 0.3]


def test_a_plain_step_wins_when_no_tree_pays():
    assert NodeBudget(STEEP, calibrate=False).choose(star([0.25, 0.01])).size == 1  # 1.25 / 1.3 < 1 / 1


def test_kept_nodes_are_ancestor_closed_even_when_estimates_are_not_monotone():
    # node 2 is node 1's child but claims more than its parent: it cannot be accepted without node 1, so it
    # counts as 0.1 too; uncapped, node 2 would come first and be verified without its parent
    tree = star([0.1, 0.95, 0.6], parents=[-1, 0, 1, 0])
    kept = NodeBudget(STEEP, calibrate=False).choose(tree)
    assert kept.tokens.tolist() == [10, 13]  # 1.6 / 1.3 beats 1.7 / 1.45 and 1.8 / 1.6


def test_without_estimates_the_tree_is_verified_whole():
    tree = DraftTree(tokens=torch.arange(4), parents=torch.tensor([-1, 0, 0, 1]))
    assert NodeBudget(STEEP).choose(tree) is tree


def test_calibration_moves_to_the_observed_rate():
    cal = Calibration(prior=8.0)
    probs = torch.full((100,), 0.95, dtype=torch.float64)
    assert float(cal(probs[:1])) == pytest.approx(0.95)
    cal.observe(probs, torch.arange(100) < 30)  # the proposer claims 0.95, the target accepts 30%
    assert float(cal(probs[:1])) == pytest.approx((8 * 0.95 + 30) / 108)
    assert float(cal(torch.tensor([0.01], dtype=torch.float64))) == pytest.approx(0.01)  # other bins untouched


def test_the_budget_observes_the_verified_tree():
    budget = NodeBudget(FLAT)
    tree = star([0.95, 0.95])
    budget.observe(tree, VerifyResult(path=torch.tensor([0, 2]), tokens=torch.tensor([12, 5])))
    bin_ = budget.calibration._bins(torch.tensor([0.95], dtype=torch.float64))
    assert float(budget.calibration.seen[bin_]) == 10 and float(budget.calibration.accepted[bin_]) == pytest.approx(8.6)


def test_hit_rates_count_positions_the_commit_reaches():
    rates = HitRates(max_ngram=3, depth=4)
    assert rates.path_probs(3, 3) == pytest.approx([0.5, 0.25, 0.125])  # the prior: one hit in two
    rates.observe(3, [7, 8, 9, 10], committed=[7, 8, 1])  # 2 hits, a miss at depth 2, depth 3 unseen
    assert rates.hits[3].tolist() == [2, 2, 1, 1] and rates.seen[3].tolist() == [3, 3, 3, 2]
    rates.observe(3, [7, 8], committed=[7])  # depth 1 lies past the commit: unobserved
    assert rates.seen[3].tolist() == [4, 3, 3, 2] and rates.hits[3].tolist() == [3, 2, 1, 1]
    assert rates.path_probs(1, 1) == pytest.approx([0.5])  # per n-gram length


def test_graft_keeps_the_larger_estimate_of_a_shared_node():
    tree = star([0.4, 0.1])  # tokens 11 (0.4), 12 (0.1)
    grafted = tree.graft([[12, 30]], max_new_nodes=4, path_probs=[[0.7, 0.5]])
    assert grafted.tokens.tolist() == [10, 11, 12, 30]
    assert grafted.accept_probs.tolist() == [1.0, 0.4, 0.7, 0.5]
    assert tree.graft([[12, 30]], 4).accept_probs is None  # no estimates for the grafted path: none at all
    plain = DraftTree(tokens=torch.arange(3), parents=torch.tensor([-1, 0, 0]))
    assert plain.graft([[5]], 4, path_probs=[[0.5]]).accept_probs is None  # no estimates for the tree


def test_subtree_renumbers_and_keeps_rows():
    tree = star([0.4, 0.3, 0.2], parents=[-1, 0, 1, 1])
    sub = tree.subtree(torch.tensor([0, 1, 3]))
    assert sub.tokens.tolist() == [10, 11, 13] and sub.parents.tolist() == [-1, 0, 1]
    assert sub.accept_probs.tolist() == [1.0, 0.4, 0.2]


@pytest.mark.parametrize("cost", [STEEP, FLAT], ids=["steep", "flat"])
def test_greedy_with_a_budget_equals_plain_greedy(target, cost):
    prompt = repetitive_prompt()
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=40).output_ids
    proposer = WithNodeBudget(WithPromptLookup(EagleProposer(random_eagle_head(target))), NodeBudget(cost))
    whole = []  # tree sizes as drafted and as verified
    choose = proposer.budget.choose

    def spy(tree, batch=1):
        kept = choose(tree, batch)
        whole.append((tree.size, kept.size))
        return kept

    proposer.budget.choose = spy
    res = Engine(target, proposer).generate(prompt, max_new_tokens=40)
    assert res.output_ids == plain
    assert res.stats.drafted > 0
    pruned = sum(kept < size for size, kept in whole)
    assert pruned > 0 if cost is STEEP else pruned == 0


# A CPU-like batch: 8 rows, where every padded node costs every row (a width of 2 already costs 1.4 plain steps).
BUSY = VerifyCosts(fixed=VerifyCost(nodes=(1, 2, 4, 8), seconds=(0.05, 0.07, 0.10, 0.16)))


def test_rows_choose_one_width_together():
    budget = NodeBudget(STEEP, calibrate=False)
    trees = [star([0.9, 0.8, 0.7], parents=[-1, 0, 1, 2]), star([0.1, 0.05])]
    kept = budget.choose_rows(trees, batch=2)
    # width 4: (2 + 2.4 + 0.15) / 1.6 = 2.84 beats width 3: (2 + 1.7 + 0.15) / 1.45 = 2.66 and width 2: 3.0 / 1.3
    assert [t.size for t in kept] == [4, 3]
    alone = NodeBudget(STEEP, calibrate=False).choose(trees[1])
    assert alone.size == 1  # alone the weak row's nodes are not worth a wider verify; beside the strong one they ride
    narrow = NodeBudget(STEEP, calibrate=False).choose_rows([trees[0], star([0.1, 0.05, 0.02, 0.01])], batch=2)
    assert [t.size for t in narrow] == [4, 4] and narrow[1].tokens.tolist() == [10, 11, 12, 13]  # its best three


def test_a_busy_batch_verifies_plainly_what_a_lone_row_would_draft():
    tree = star([0.6, 0.5, 0.4], parents=[-1, 0, 1, 2])
    assert NodeBudget(STEEP, calibrate=False).choose(tree).size == 4
    budget = NodeBudget(BUSY, calibrate=False)
    assert [t.size for t in budget.choose_rows([tree], batch=8)] == [1]  # (8 + 0.6) / 1.4 < 8 / 1
    many = budget.choose_rows([tree] * 8, batch=8)  # every row drafting: (8 + 8 * 1.1) / 2 > 1
    assert [t.size for t in many] == [4] * 8 or [t.size for t in many] == [3] * 8


def test_a_tree_without_estimates_sets_the_least_width():
    budget = NodeBudget(BUSY, calibrate=False)
    plain = DraftTree(tokens=torch.arange(3), parents=torch.tensor([-1, 0, 1]))
    kept = budget.choose_rows([plain, star([0.6, 0.5, 0.4], parents=[-1, 0, 1, 2])], batch=8)
    assert kept[0] is plain and kept[1].size >= 3  # the width is paid anyway: the other row fills it


def test_stop_below_is_the_weakest_node_kept_lately():
    budget = NodeBudget(STEEP, calibrate=False, memory=2)
    assert budget.stop_below() == 0.0  # nothing chosen yet: draft as deep as configured
    budget.choose(star([0.05, 0.9, 0.3, 0.02]))  # keeps 0.9 and 0.3
    assert budget.stop_below() == pytest.approx(0.3)
    budget.choose(star([0.2]))  # keeps nothing: even the best node, 0.2, was not worth it
    assert budget.stop_below() == pytest.approx(0.2)  # the lower of the two recent steps
    budget.choose(star([0.95, 0.8]))  # keeps both
    budget.choose(star([0.95, 0.8]))  # the memory holds two steps: 0.2 is forgotten
    assert budget.stop_below() == pytest.approx(0.8)


def test_eagle_stops_expanding_below_the_floor(target):
    head = random_eagle_head(target)
    prompt = repetitive_prompt()
    depths = {}
    for floor in (0.0, 0.999):
        proposer = EagleProposer(head, stop_below=lambda f=floor: f)
        ctx = start_proposer(proposer, target, prompt)
        depths[floor] = proposer.propose(ctx).max_depth
    assert depths[0.0] == 5 and depths[0.999] == 1  # level 1 is always drafted


def test_ngram_with_the_default_budget_equals_plain_greedy(target):
    from specheads.inference.methods import METHODS, make_proposer

    prompt = repetitive_prompt()
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=40).output_ids
    proposer = make_proposer("ngram", target, METHODS.get("ngram").make_options({}), None)
    assert isinstance(proposer, WithNodeBudget)  # the default
    res = Engine(target, proposer).generate(prompt, max_new_tokens=40)
    assert res.output_ids == plain and res.stats.drafted > 0


def test_an_unknown_budget_is_refused_before_anything_loads():
    from specheads.inference.methods import METHODS

    for method in ("ngram", "eagle"):
        with pytest.raises(ValueError, match="unknown --node-budget 'cheap'; use one of: auto, fixed"):
            METHODS.get(method).make_options({"heads": ".", "node_budget": "cheap"} if method == "eagle"
                                             else {"node_budget": "cheap"})


def test_training_measures_whole_trees_of_the_heads_alone():
    from specheads.inference.methods import METHODS

    for kind in ("eagle", "medusa"):
        options = METHODS.get(kind).heads_alone(".")
        assert (options.lookup, options.node_budget) == (0, "fixed")


class Unsure:
    """A drafter whose guesses the budget never finds worth a verify (until `sure` is set): counts its forwards."""

    needs_target_hidden = False

    def __init__(self) -> None:
        self.calls, self.sure = 0, False

    def start(self, ctx, target_hidden) -> None:
        pass

    def on_verified(self, result, target_hidden) -> None:
        pass

    def propose(self, ctx) -> DraftTree:
        self.calls += 1
        p = 0.99 if self.sure else 0.01
        return DraftTree(tokens=torch.tensor([int(ctx.tokens[-1]), 7, 8]), parents=torch.tensor([-1, 0, 0]),
                         accept_probs=torch.tensor([1.0, p, p], dtype=torch.float64))


def test_the_drafter_is_left_out_while_the_budget_keeps_nothing_and_asked_again_after_a_wait(target):
    from specheads.inference.proposers import node_budget as budget_mod

    drafter = Unsure()
    proposer = WithNodeBudget(drafter, NodeBudget(STEEP, calibrate=False))
    prompt = repetitive_prompt()
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=60).output_ids
    res = Engine(target, proposer).generate(prompt, max_new_tokens=60)
    assert res.output_ids == plain  # plain steps are exact like any other
    # 4 idle drafts, then probes after waits of 1, 2, 4, 8, 16, 16 plain steps: far fewer forwards than steps
    idle = budget_mod.SKIP_AFTER
    steps, calls = idle, idle
    wait = 1
    while steps + wait + 1 <= 60:
        steps, calls, wait = steps + wait + 1, calls + 1, min(2 * wait, budget_mod.MAX_WAIT)
    assert drafter.calls == calls and drafter.calls < 15
    drafter.sure = True  # the drafter turns useful: the next probe keeps its node and drafting resumes every step
    ctx = start_proposer(proposer, target, prompt)
    assert [proposer.propose(ctx).size for _ in range(3)] == [3, 3, 3] and drafter.calls == calls + 3


def test_rows_waiting_out_an_idle_stretch_step_plainly_and_a_row_that_drafts_carries_the_others(target):
    budget = NodeBudget(STEEP, calibrate=False)
    rows = [WithNodeBudget(Unsure(), budget), WithNodeBudget(Unsure(), budget)]
    prompt = repetitive_prompt()
    ctxs = [start_proposer(r, target, prompt) for r in rows]
    sizes = [[t.size for t in WithNodeBudget.propose_many(rows, ctxs)] for _ in range(8)]
    assert sizes[:4] == [[1, 1]] * 4 and [r.inner.calls for r in rows] == [5, 5]  # 4 idle, a wait of 1, a probe
    rows[1].inner.sure = True
    sizes = [[t.size for t in WithNodeBudget.propose_many(rows, ctxs)] for _ in range(6)]
    # once the sure row probes, it drafts every step, and the width it pays for carries the other row's nodes too
    assert sizes[-1] == [3, 3] and rows[0]._skip == 0


def test_a_drafter_that_proposes_nothing_is_still_asked_every_step(target):
    class NoMatch(Unsure):  # a lookup without a match: nothing drafted, nothing for the budget to cut
        def propose(self, ctx) -> DraftTree:
            self.calls += 1
            return DraftTree.root_only(ctx.tokens[-1])

    proposer = WithNodeBudget(NoMatch(), NodeBudget(STEEP, calibrate=False))
    ctx = start_proposer(proposer, target, repetitive_prompt())
    assert [proposer.propose(ctx).size for _ in range(12)] == [1] * 12 and proposer.inner.calls == 12
