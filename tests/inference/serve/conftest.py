"""The serving tests' target and tokenizer: the tiny Llama (seed 0) and the word-level tokenizer, built once per test
file (a file with other needs defines its own)."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()
