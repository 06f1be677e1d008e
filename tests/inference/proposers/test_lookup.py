"""Prompt lookup grafted onto heads' trees: the heads' tree stays, the lookup path is added, greedy
output still equals plain greedy, and `--lookup` / `+lookup=N` reach the proposer."""

from __future__ import annotations

import pytest
import torch

from specheads.heads.checkpoint import TargetInfo, save_drafter
from specheads.inference import Engine
from specheads.inference.bench.method_spec import parse_methods
from specheads.inference.methods import METHODS, make_proposer
from specheads.inference.methods.options import DEFAULT_SUFFIX_GRAFT
from specheads.inference.proposers import AutoregressiveProposer
from specheads.inference.proposers.eagle import EagleProposer
from specheads.inference.proposers.lookup import DEFAULT_LOOKUP, WithPromptLookup
from specheads.inference.proposers.medusa import MEDUSA_TREES, MedusaProposer
from specheads.inference.proposers.ngram import find_matches
from specheads.inference.proposers.node_budget import WithNodeBudget
from specheads.inference.proposers.suffix import SuffixProposer
from tests.conftest import random_eagle_head, repetitive_prompt, start_proposer, tiny_model
from tests.inference.proposers.test_medusa_proposer import random_heads

MAX_NEW = 40


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama")


def test_the_lookup_path_is_grafted_onto_the_heads_tree(target):
    head = random_eagle_head(target)
    span = [10, 11, 12, 13, 14, 15]
    prompt = [3, 4, 5, *span, 20, 21, 22, *span[:3]]  # ends inside a repeated span: lookup continues it
    alone = EagleProposer(head)
    alone_tree = alone.propose(start_proposer(alone, target, prompt))
    both = WithPromptLookup(EagleProposer(head))
    ctx = start_proposer(both, target, prompt)
    tree = both.propose(ctx)
    ((_, cont),) = find_matches(ctx.tokens, DEFAULT_LOOKUP, DEFAULT_LOOKUP.depth)
    assert cont == [13, 14, 15, 20, 21, 22, 10, 11][: DEFAULT_LOOKUP.depth]
    n = alone_tree.size
    assert torch.equal(tree.tokens[:n], alone_tree.tokens) and torch.equal(tree.parents[:n], alone_tree.parents)
    assert tree.size > n  # random heads do not guess the whole continuation
    node, path = 0, []  # walk the continuation from the root: every token is some node's child
    for tok in cont:
        node = next(c for c in tree.children[node] if int(tree.tokens[c]) == tok)
        path.append(node)
    assert tree.depths[path].tolist() == list(range(1, len(cont) + 1))


@pytest.mark.parametrize("heads", ["eagle", "medusa"])
def test_greedy_with_lookup_equals_plain_greedy(target, heads):
    prompt = repetitive_prompt()
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=MAX_NEW).output_ids

    def inner():
        if heads == "eagle":
            return EagleProposer(random_eagle_head(target))
        return MedusaProposer(random_heads(target), MEDUSA_TREES["medusa-16"])

    alone = Engine(target, inner()).generate(prompt, max_new_tokens=MAX_NEW)
    both = Engine(target, WithPromptLookup(inner())).generate(prompt, max_new_tokens=MAX_NEW)
    assert alone.output_ids == plain and both.output_ids == plain
    assert both.stats.drafted > alone.stats.drafted  # the prompt's repeated spans got looked up and verified


def test_lookup_option_wraps_the_heads_or_not(target, tmp_path):
    save_drafter(tmp_path, random_heads(target, num_heads=2), TargetInfo.from_model(target, "tiny"))
    medusa = METHODS.get("medusa")

    def proposer(**values):
        values = {"heads": str(tmp_path), "node_budget": "fixed", **values}  # no budget wrapped around it
        return make_proposer("medusa", target, medusa.make_options(values), None)

    default = proposer()
    assert isinstance(default, WithPromptLookup) and default.config == DEFAULT_LOOKUP
    budgeted = proposer(node_budget=None)  # the default budget wraps the heads with lookup grafted on
    assert isinstance(budgeted, WithNodeBudget) and isinstance(budgeted.inner, WithPromptLookup)
    three = proposer(lookup=3)
    assert three.config.num_candidates == 3 and three.config.max_nodes == 3 * DEFAULT_LOOKUP.depth
    assert isinstance(proposer(lookup=0), MedusaProposer)
    with pytest.raises(ValueError, match="--lookup must be >= 0"):
        proposer(lookup=-1)


def test_bench_specs_take_a_lookup_suffix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for folder in ("runs/x/final", "runs/m/final"):
        (tmp_path / folder).mkdir(parents=True)
    specs = parse_methods("eagle:runs/x/final+lookup=0,eagle:runs/x/final@eagle2+lookup=2,medusa:runs/m/final")
    assert [(s.arg, s.tree, s.lookup) for s in specs] == [
        ("runs/x/final", None, 0), ("runs/x/final", "eagle2", 2), ("runs/m/final", None, None)]
    for bad, message in (("eagle:runs/x/final+lookup=", "--lookup takes an integer, got ''"),
                         ("eagle:runs/x/final+lookup=-1", "--lookup must be >= 0"),
                         ("eagle:+lookup=1", r"eagle needs a path before its suffixes: eagle:DIR\[@TREE\]")):
        with pytest.raises(ValueError, match=message):
            parse_methods(bad)
    spec = parse_methods("eagle:runs/x/final@eagle2+draft_dtype=int8+lookup=0")[0]
    assert (spec.arg, spec.tree, spec.lookup, spec.options.draft_dtype) == ("runs/x/final", "eagle2", 0, "int8")
    assert spec.settings == (("draft_dtype", "int8"), ("lookup", "0"))
    with pytest.raises(ValueError, match="unknown --draft-dtype 'int4'; use one of: target, int8"):
        parse_methods("eagle:runs/x/final+draft_dtype=int4")
    (ngram,) = parse_methods("ngram+node_budget=fixed+width=2")  # suffixes on a method without an argument
    assert (ngram.method, ngram.arg, ngram.options.node_budget, ngram.options.width) == ("ngram", None, "fixed", 2)
    for bad, message in (("ngram:3+width=2", "method ngram takes no argument"),
                         ("ngram+wdth=2", r"ngram has no option 'wdth' \(its options: depth, width, node_budget\)"),
                         ("ar+lookup=0", r"ar has no option 'lookup' \(its options: none\)")):
        with pytest.raises(ValueError, match=message):
            parse_methods(bad)


def test_the_suffix_graft_drafts_earlier_answers_onto_the_heads_tree(target, tmp_path):
    save_drafter(tmp_path, random_heads(target, num_heads=2), TargetInfo.from_model(target, "tiny"))
    medusa = METHODS.get("medusa")

    def proposer(**values):
        return make_proposer("medusa", target, medusa.make_options({"heads": str(tmp_path), "node_budget": "fixed",
                                                                     "graft": "suffix", **values}), None)

    grafted = proposer()
    assert isinstance(grafted, WithPromptLookup) and isinstance(grafted.lookup, SuffixProposer)
    assert grafted.config.max_tree_nodes == DEFAULT_SUFFIX_GRAFT.max_tree_nodes and grafted.lookup.cache is not None
    assert grafted.fork().lookup.cache is grafted.lookup.cache  # rows share the answers
    isolated = proposer(isolate=1, lookup=2)
    assert isolated.lookup.cache is None and isolated.config.max_tree_nodes == 2 * DEFAULT_SUFFIX_GRAFT.max_tree_nodes

    prompt = repetitive_prompt(seed=4)
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=MAX_NEW).output_ids
    engine = Engine(target, grafted)
    first = engine.generate(prompt, max_new_tokens=MAX_NEW)
    again = engine.generate(prompt, max_new_tokens=MAX_NEW)  # the first answer is grafted onto the heads' trees
    assert first.output_ids == again.output_ids == plain
    assert again.stats.tau > max(first.stats.tau, 4.0), (first.stats.tau, again.stats.tau)
