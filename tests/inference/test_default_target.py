"""Golden equivalence on the real default target (SmolLM2-135M-Instruct) with MT-bench prompts."""

from __future__ import annotations

import pytest
import torch

from specheads.draft_models import early_exit_model
from specheads.inference import Engine
from specheads.inference.proposers import AutoregressiveProposer
from specheads.inference.proposers.draft_model import DraftConfig, DraftModelProposer
from specheads.inference.proposers.ngram import NgramProposer
from specheads.inference.proposers.suffix import SuffixProposer
from specheads.questions import Question

pytestmark = pytest.mark.slow

# Two MT-bench-style first turns (MT-bench's question file is not part of the repository): a reasoning and a coding
# one. A third, writing, prompt added half a minute to each test and no case.
PROMPTS = [
    Question(101, "reasoning", ("Imagine you are participating in a race with a group of people. If you have just "
                                "overtaken the second person, what's your current position? Where is the person you "
                                "just overtook?",)),
    Question(121, "coding", ("Develop a Python program that reads all the text files under a directory and returns "
                             "top-5 words with the most number of occurrences.",)),
]
MAX_NEW = 40


@pytest.fixture(scope="module")
def default_target():
    from specheads.target import load_target

    return load_target("default")


def test_every_method_reproduces_hf_greedy_on_the_default_target(default_target):
    from specheads.target import render_chat, stop_token_ids

    model, tokenizer = default_target
    stops = stop_token_ids(tokenizer, model)
    engines = {
        "ar": Engine(model, AutoregressiveProposer()),
        "ngram": Engine(model, NgramProposer()),
        "suffix": Engine(model, SuffixProposer()),  # from the second prompt on, also the earlier answers
        "early-exit:8": Engine(model, DraftModelProposer(early_exit_model(model, 8), DraftConfig(depth=3, width=2))),
    }
    drafted = 0
    for q in PROMPTS:
        prompt = render_chat(tokenizer, [q.turns[0]])
        ids = torch.tensor([prompt])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                            eos_token_id=stops, pad_token_id=stops[0])[0, len(prompt):].tolist()
        for name, engine in engines.items():
            res = engine.generate(prompt, max_new_tokens=MAX_NEW, stop_token_ids=stops)
            assert res.output_ids == hf, (name, q.question_id)
            drafted += res.stats.drafted
    assert drafted > 0


def test_every_method_on_llamacpps_kernels_reproduces_its_plain_greedy(default_target):
    # the default target's F32 GGUF on llama.cpp (f32 cache): ar there is llama.cpp's plain decoding, and every
    # proposer's greedy output is it, token for token, on real text
    from specheads.inference.engine.llamacpp_backend import llamacpp_backend
    from specheads.target import render_chat, stop_token_ids

    model, tokenizer = default_target
    stops = stop_token_ids(tokenizer, model)
    proposers = {"ngram": NgramProposer(), "suffix": SuffixProposer(),
                 "early-exit:8": DraftModelProposer(early_exit_model(model, 8), DraftConfig(depth=3, width=2))}
    drafted = 0
    for q in PROMPTS:
        prompt = render_chat(tokenizer, [q.turns[0]])
        plain = Engine(model, AutoregressiveProposer(), backend=llamacpp_backend("default", "f32")).generate(
            prompt, max_new_tokens=MAX_NEW, stop_token_ids=stops)
        for name, proposer in proposers.items():
            engine = Engine(model, proposer, backend=llamacpp_backend("default", "f32"))
            res = engine.generate(prompt, max_new_tokens=MAX_NEW, stop_token_ids=stops)
            assert res.output_ids == plain.output_ids, (name, q.question_id)
            drafted += res.stats.drafted
    assert drafted > 0
