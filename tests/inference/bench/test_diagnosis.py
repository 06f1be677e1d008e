"""Acceptance diagnosis on a constructed run: a proposer that drafts the target's own greedy continuation but is
always wrong where the target writes a "bracket" token; every rejection is attributed to the bracket class at the
position of the first bracket, steps without one ran out of draft, and the rows sum to the drafting steps."""

from __future__ import annotations

import pytest
import torch

from specheads.inference import Engine
from specheads.inference.bench.diagnosis import (
    RAN_OUT,
    RejectionLog,
    by_category,
    diagnosis_markdown,
    summarise,
)
from specheads.inference.engine.tree import DraftTree
from specheads.inference.proposers import AutoregressiveProposer
from specheads.token_classes import TOKEN_CLASSES, TokenClasses
from tests.conftest import repetitive_prompt, tiny_model

DEPTH = 3


class WrongOnBrackets:
    """Drafts the next DEPTH tokens of a known text, but a wrong token in place of the first bracket."""

    needs_target_hidden = False

    def __init__(self, text: list[int], brackets: set[int], vocab: int) -> None:
        self.text, self.brackets, self.vocab = text, brackets, vocab

    def start(self, ctx, target_hidden) -> None:
        pass

    def propose(self, ctx) -> DraftTree:
        n = ctx.tokens.shape[0]
        chain = []
        for token in self.text[n : n + min(DEPTH, ctx.max_depth)]:
            if token in self.brackets:
                chain.append((token + 1) % self.vocab)
                break
            chain.append(token)
        tokens = torch.tensor([int(ctx.tokens[-1]), *chain])
        return DraftTree(tokens=tokens, parents=torch.arange(-1, len(chain)))

    def on_verified(self, result, target_hidden) -> None:
        pass


def test_rejections_are_attributed_to_the_bracket_class_at_the_right_positions():
    target = tiny_model("llama")
    vocab = target.config.vocab_size
    prompt = repetitive_prompt()
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=48).output_ids
    text = list(prompt) + plain
    brackets = set(sorted(set(plain))[::3])  # a third of the output's distinct tokens play brackets
    of_token = torch.full((vocab,), TOKEN_CLASSES.index("word"))
    of_token[sorted(brackets)] = TOKEN_CLASSES.index("structural")
    classes = TokenClasses(of_token=of_token)

    log = RejectionLog(category="coding")
    engine = Engine(target, WrongOnBrackets(text, brackets, vocab), speculation=log)
    res = engine.generate(prompt, max_new_tokens=48)
    assert res.output_ids == plain  # a diagnosis never changes the output

    rejected = [s for s in log.steps if s.position != RAN_OUT]
    assert rejected and len(rejected) < len(log.steps)  # some steps hit a bracket, some ran out of draft
    for step in rejected:
        assert step.target_token in brackets and step.draft_token == (step.target_token + 1) % vocab
    # the position: the first bracket of the window the step drafted from
    n = len(prompt) + 1  # the prefill's token is committed first
    for step in log.steps:
        window = text[n : n + DEPTH]
        first = next((i + 1 for i, t in enumerate(window) if t in brackets), RAN_OUT)
        assert step.position == first, (n, window, step)
        n += (step.position if step.position != RAN_OUT else len(window)) + (0 if step.position != RAN_OUT else 1)

    summary = summarise(log, classes)
    assert summary.steps == len(log.steps) == res.stats.draft_steps
    assert sum(r.steps for r in summary.rows) == summary.steps
    assert {r.target_class for r in summary.rows if r.position != RAN_OUT} == {"structural"}
    assert summary.stopped_on["structural"] == len(rejected) / len(log.steps) and summary.stopped_on["word"] == 0
    assert summary.by_position[RAN_OUT] == len(log.steps) - len(rejected)
    assert summary.acceptance == {"word": 1.0, "structural": 0.0}  # other classes were never drafted at
    top = summary.most_rejected[0]
    assert top.target_class == "structural" and top.accepted == 0 and top.acceptance_rate == 0.0
    assert summary.to_json()["rows"][0]["category"] == "coding"
    steps, shares, ran_out = by_category(summary)["coding"]
    assert steps == summary.steps and shares["structural"] + ran_out == pytest.approx(1.0)
    table = diagnosis_markdown({"m": summary}, str)
    assert "| coding |" in table and "| m | 1.00 | - | - | 0.00 | - | - |" in table  # acceptance by class
