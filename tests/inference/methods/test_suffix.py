"""The `suffix` method's options, and the suffix graft of the heads methods: settings reach the config, bad values
fail before anything loads, naming the fix."""

from __future__ import annotations

import pytest

from specheads.inference.methods import METHODS, option_flags
from specheads.inference.methods.options import SuffixConfig


def test_options_become_the_config():
    method = METHODS.get("suffix")
    assert method.make_options({}).config() == SuffixConfig()
    config = method.make_options({"max_depth": 4, "max_tree_nodes": 6, "factor": 0.5, "min_prob": 0.2,
                                  "cache_tokens": 0, "isolate": 1}).config()
    assert (config.max_depth, config.max_tree_nodes, config.factor, config.min_prob) == (4, 6, 0.5, 0.2)
    assert config.isolate and not config.shares and config.tree_depth == config.max_match + 4
    assert not SuffixConfig().isolate and SuffixConfig().shares  # a shared cache by default
    assert not SuffixConfig(cache_tokens=0).shares


@pytest.mark.parametrize("values,message", [
    ({"isolate": 2}, "--isolate takes 0 or 1"),
    ({"cache_tokens": -1}, "--cache-tokens must be >= 0"),
    ({"factor": 0.0}, "--factor must be > 0"),
    ({"min_prob": 1.5}, r"--min-prob must be in \[0, 1\]"),
    ({"max_depth": 0}, "needs max_depth, max_tree_nodes and max_match >= 1"),
    ({"node_budget": "some"}, "unknown --node-budget 'some'"),
    ({"lookup": 1}, "--lookup does not apply to --method suffix"),
])
def test_bad_options_are_refused_with_the_fix(values, message):
    with pytest.raises(ValueError, match=message):
        METHODS.get("suffix").make_options(values)


def test_heads_methods_take_the_suffix_graft(tmp_path):
    eagle = METHODS.get("eagle")
    options = eagle.make_options({"heads": str(tmp_path), "graft": "suffix", "isolate": 1})
    assert (options.graft, options.isolate) == ("suffix", 1)
    with pytest.raises(ValueError, match="unknown --graft 'trie'; use one of: ngram, suffix"):
        eagle.make_options({"heads": str(tmp_path), "graft": "trie"})
    with pytest.raises(ValueError, match="--isolate applies to --graft suffix"):
        eagle.make_options({"heads": str(tmp_path), "isolate": 1})
    helps = {f.name: f.help for f in option_flags()}
    assert "suffix" in helps["isolate"] and "eagle" in helps["graft"]
