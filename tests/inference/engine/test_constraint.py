"""Structured outputs: a grammar over the output keeps decoding exact with respect to the constrained target (the
target's law masked by the grammar at every node), greedy and sampled, for every proposer and batched rows; drafts
the grammar forbids are pruned and the tokens it forces are drafted for free."""

from __future__ import annotations

import json
from unittest.mock import patch

import pytest
import torch

pytest.importorskip("llguidance")

import specheads.inference.engine.engine as engine_mod  # noqa: E402
from specheads.inference.engine.constraint import GrammarConstraint  # noqa: E402
from specheads.inference.engine.engine import Engine  # noqa: E402
from specheads.inference.engine.extra_rows import ExtraRows  # noqa: E402
from specheads.inference.engine.grammar import json_schema_grammar, regex_grammar  # noqa: E402
from specheads.inference.engine.proposer import AutoregressiveProposer  # noqa: E402
from specheads.inference.engine.sampling import SamplingParams  # noqa: E402
from specheads.inference.engine.tree import DraftTree  # noqa: E402
from specheads.inference.methods import METHODS, make_proposer  # noqa: E402
from tests.conftest import BYTE_VOCAB, byte_tokenizer, tiny_model  # noqa: E402
from tests.drafters import (  # noqa: E402
    DRAFTERS,
    _verify_keeping_a_rejected_draft,
    bigram_target,
    chi_square_p,
    first_two_tokens,
    proposer_for,
    save_case,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TOKENIZER = byte_tokenizer()
END = TOKENIZER.eos_token_id
SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["colour", "count", "ok"], "additionalProperties": False}


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def constraint(grammar, model) -> GrammarConstraint:
    return GrammarConstraint(grammar, TOKENIZER, vocab_size=model.config.vocab_size, stop_token_ids=[END])


@torch.no_grad()
def reference_constrained_greedy(model, prompt: list[int], grammar, max_new_tokens: int) -> list[int]:
    """Plain constrained greedy decoding, written independently of the engine: a full forward per token (no cache),
    the grammar's mask from a fresh llguidance matcher, the end token allowed where the grammar accepts."""
    import llguidance
    import llguidance.hf

    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(TOKENIZER), grammar.source, log_level=0)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
        bits = torch.tensor(list(matcher.compute_bitmask()), dtype=torch.uint8)
        allowed = ((bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten().bool()[: logits.shape[0]]
        allowed[END] = matcher.is_accepting()
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        out.append(token)
        if token == END:
            break
        assert matcher.consume_token(token)
    return out


PROMPT = ids('Answer: {"colour": "green", "count": 12, "ok": true} and {"colour": "red", "count": 3, "ok": false}. ')


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_output_equals_plain_constrained_decoding(arch, tmp_path):
    """`ar`, prompt lookup and EAGLE-3 heads under the schema all reproduce the independent constrained reference,
    token for token, and the finished answer is a document the schema accepts."""
    model = tiny_model(arch, vocab=BYTE_VOCAB)
    grammar = json_schema_grammar(SCHEMA)
    want = reference_constrained_greedy(model, PROMPT, grammar, max_new_tokens=48)
    save_case("eagle3", model, tmp_path)
    proposers = {"ar": AutoregressiveProposer(),
                 "ngram": make_proposer("ngram", model, METHODS.get("ngram").make_options({}), None),
                 "eagle3": proposer_for("eagle3", model, tmp_path, DRAFTERS["eagle3"].options[0])}
    for name, proposer in proposers.items():
        res = Engine(model, proposer).generate(PROMPT, max_new_tokens=48, constraint=constraint(grammar, model),
                                               stop_token_ids=[END])
        assert res.output_ids == want, name
        assert res.stats.drafted > 0, name  # at least the forced tokens were drafted
    if want[-1] == END:
        document = json.loads(TOKENIZER.decode(want[:-1]))
        assert set(document) == {"colour", "count", "ok"} and document["colour"] in ("red", "green", "blue")


def test_forced_tokens_are_drafted_and_accepted():
    """The schema fixes its keys and punctuation: `ar` drafts them for free, so it commits them in fewer target
    forwards than tokens, and each forced token it drafted was accepted."""
    model = tiny_model("llama", vocab=BYTE_VOCAB)
    grammar = json_schema_grammar(SCHEMA)
    res = Engine(model, AutoregressiveProposer()).generate(PROMPT, max_new_tokens=40,
                                                           constraint=constraint(grammar, model), stop_token_ids=[END])
    assert res.stats.accepted > 0 and res.stats.steps < res.stats.new_tokens
    assert res.output_ids[:3] == ids('{"c')  # the first key's opening is forced


def test_forbidden_deterministic_drafts_are_pruned_and_sampled_ones_kept():
    model = tiny_model("llama", vocab=BYTE_VOCAB)
    digit, letter = ids("7")[0], ids("x")[0]
    root = ids("=")[0]
    tree = DraftTree(tokens=torch.tensor([root, letter, digit, digit]), parents=torch.tensor([-1, 0, 0, 2]))
    c = constraint(regex_grammar("[0-9]+"), model)
    shaped = c.shape(tree, max_depth=4)
    assert shaped.tokens.tolist() == [root, digit, digit] and shaped.parents.tolist() == [-1, 0, 1]
    logits = c.mask_logits(shaped, torch.zeros(3, BYTE_VOCAB))
    digits = torch.tensor(ids("0123456789"))
    assert bool(torch.isfinite(logits[0, digits]).all()) and int(torch.isfinite(logits[0]).sum()) == 10
    assert bool(torch.isfinite(logits[1, END]))  # one digit in: the answer may end
    # A reshaped tree keeps the verify forward's extra rows (lookahead's window): they see only the root.
    window = ExtraRows(tokens=torch.tensor([letter, digit]), depths=torch.tensor([1, 2]),
                       sees=torch.tensor([[True, False], [True, True]]))
    with_rows = c.shape(DraftTree(tokens=tree.tokens, parents=tree.parents, extra=window), max_depth=4)
    assert with_rows.size == 3 and with_rows.extra is window
    # With draft distributions, a forbidden child stays for verification to reject (pruning would change the law).
    probs = torch.full((4, BYTE_VOCAB), 1.0 / BYTE_VOCAB)
    sampled = c.shape(DraftTree(tokens=tree.tokens, parents=tree.parents, draft_probs=probs), max_depth=4)
    assert sampled.size == 4


def test_rows_with_different_grammars_decode_as_alone():
    model = tiny_model("llama", vocab=BYTE_VOCAB)
    grammars = [json_schema_grammar(SCHEMA), regex_grammar("[a-c]{2,6}( [0-9]+)?"), None]
    alone = []
    for g in grammars:
        c = constraint(g, model) if g is not None else None
        alone.append(Engine(model, AutoregressiveProposer()).generate(PROMPT, max_new_tokens=24, constraint=c,
                                                                     stop_token_ids=[END]).output_ids)
    proposer = make_proposer("ngram", model, METHODS.get("ngram").make_options({}), None)
    engine = Engine(model, proposer, max_rows=3)
    seqs = [engine.add(PROMPT, max_new_tokens=24, stop_token_ids=[END],
                       constraint=constraint(g, model) if g is not None else None) for g in grammars]
    while any(not s.done for s in seqs):
        engine.step()
    assert [s.output for s in seqs] == alone


LETTERS = "abcdefghijklmnop"
COUNTING = ids(LETTERS + LETTERS[:9])  # ends at "i": lookup drafts "jklm..."
PARAMS = SamplingParams(temperature=1.0, top_k=3)


@torch.no_grad()
def constrained_two_token_law(model) -> dict[tuple[int, int], float]:
    """P(x1, x2) under `[a-z]+` then the end token, the masks written by hand (no grammar engine)."""
    letters = torch.tensor(ids("abcdefghijklmnopqrstuvwxyz"))

    def probs(prefix: list[int], may_end: bool) -> torch.Tensor:
        logits = model(torch.tensor([prefix])).logits[0, -1].float()
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        allowed[letters] = True
        allowed[END] = may_end
        return PARAMS.probs(logits.masked_fill(~allowed, float("-inf")))

    p1 = probs(COUNTING, may_end=False)
    law = {}
    for x1 in p1.nonzero().flatten().tolist():
        p2 = probs(COUNTING + [x1], may_end=True)
        for x2 in p2.nonzero().flatten().tolist():
            law[(x1, x2)] = float(p1[x1] * p2[x2])
    return law


def test_sampling_keeps_the_constrained_law():
    """Chi-square of the first two sampled tokens against the constrained target's exact law, prompt lookup drafting
    counting runs that the target mostly continues; a verifier that keeps a rejected draft fails the same test."""
    model = bigram_target(vocab=BYTE_VOCAB)
    law = constrained_two_token_law(model)
    # Whole trees (as the drafter kinds' sampling checks): which nodes are verified never matters to the law.
    options = METHODS.get("ngram").make_options({"node_budget": "fixed"})
    engine = Engine(model, make_proposer("ngram", model, options, None), max_rows=2)
    def per_sequence() -> dict:
        return {"stop_token_ids": [END], "constraint": constraint(regex_grammar("[a-z]+"), model)}

    counts, accepted = first_two_tokens(engine, COUNTING, PARAMS, 500, per_sequence)
    assert accepted > 125, accepted
    assert chi_square_p(counts, law) > 1e-3, counts
    with patch.object(engine_mod, "verify", _verify_keeping_a_rejected_draft):
        broken, _ = first_two_tokens(engine, COUNTING, PARAMS, 500, per_sequence)
    assert chi_square_p(broken, law) < 1e-6, broken
