"""Token classes as defined in `specheads.token_classes`, on a tiny tokenizer whose strings are chosen for it, and
on the default target's real tokenizer when it is installed."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from specheads.token_classes import TOKEN_CLASSES, text_class, token_classes

WANTED = {  # token text -> class
    "hello": "word", "ing": "word", "x1": "word", "<|im_end|>": "end_of_turn", "</s>": "end_of_turn",
    "    ": "whitespace", "\n": "whitespace", "\n\t": "whitespace",
    "42": "digits", "3.14": "digits", "1,000": "digits",
    "{": "structural", "}": "structural", "[": "structural", '":': "structural", "},": "structural", "=": "structural",
    "(": "punctuation", ")": "punctuation", ".": "punctuation", "!": "punctuation", "->": "punctuation",
}


def tokenizer():
    vocab = {"<unk>": 0, **{text: i + 1 for i, text in enumerate(WANTED)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>")),
                                  unk_token="<unk>", eos_token="</s>", additional_special_tokens=["<|im_end|>"])
    return tok, vocab


def test_each_token_gets_its_class():
    tok, vocab = tokenizer()
    classes = token_classes(tok, vocab_size=len(vocab) + 3)  # a model vocabulary padded past the tokenizer's
    names = classes.names(range(len(vocab)))
    got = dict(zip(vocab, names))
    assert got.pop("<unk>") == "end_of_turn"  # special
    assert got == WANTED
    assert classes.names([len(vocab) + 2]) == ["word"]  # padding rows
    counts = classes.counts()
    assert sum(counts.values()) == len(vocab) + 3 and set(counts) == set(TOKEN_CLASSES)


def test_stop_tokens_end_a_turn_and_text_classes_cover_edge_cases():
    tok, vocab = tokenizer()
    assert token_classes(tok, stop_token_ids=[vocab["hello"]]).names([vocab["hello"]]) == ["end_of_turn"]
    assert text_class("") == "word" and text_class(" ") == "whitespace" and text_class(" 7") == "digits"
    assert text_class(' {"') == "structural" and text_class(".,") == "punctuation" and text_class("a.b") == "word"


@pytest.mark.slow
def test_the_default_targets_tokenizer():
    from specheads.target import DEFAULT_TARGET, load_target

    try:
        _, tok = load_target(DEFAULT_TARGET)
    except (OSError, ValueError) as err:
        pytest.skip(f"the default target is not installed here: {err}")
    classes = token_classes(tok)
    ids = tok.encode('def f(x):\n    return {"a": 42}\n', add_special_tokens=False)
    names = classes.names(ids)
    assert {"word", "whitespace", "structural", "digits", "punctuation"} <= set(names), list(zip(ids, names))
    assert classes.names([tok.convert_tokens_to_ids("<|im_end|>")]) == ["end_of_turn"]
