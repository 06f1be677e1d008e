"""The `lookahead` method's options: settings reach the config, bad values fail before anything loads, naming the
fix."""

from __future__ import annotations

import pytest

from specheads.inference.methods import METHODS, option_flags
from specheads.inference.methods.options import LookaheadConfig


def test_options_become_the_config():
    method = METHODS.get("lookahead")
    assert method.make_options({}).config() == LookaheadConfig()
    config = method.make_options({"window": 5, "ngram": 4, "candidates": 2, "prompt_pool": 1,
                                  "lazy_window": 1}).config()
    assert (config.window, config.ngram, config.candidates, config.prompt_pool, config.lazy_window) == \
        (5, 4, 2, True, True)
    assert config.window_rows == 3 * 5 - 1
    assert not method.make_options({"prompt_pool": 0, "lazy_window": 0}).config().prompt_pool
    assert "lookahead" in {f.name: f.help for f in option_flags()}["window"]


@pytest.mark.parametrize("values,message", [
    ({"window": 0}, "--window must be >= 1"),
    ({"ngram": 2}, "--ngram must be >= 3"),
    ({"candidates": 0}, "--candidates must be >= 1"),
    ({"prompt_pool": 2}, "--prompt-pool takes 0 or 1"),
    ({"lazy_window": 3}, "--lazy-window takes 0 or 1"),
    ({"prompt_pool": 0}, "--prompt-pool 0 needs --lazy-window 0"),
    ({"depth": 3}, "--depth does not apply to --method lookahead"),
])
def test_bad_options_are_refused_with_the_fix(values, message):
    with pytest.raises(ValueError, match=message):
        METHODS.get("lookahead").make_options(values)
