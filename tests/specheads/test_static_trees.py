"""Static Medusa trees: greedy construction, validation, presets, expected acceptance length."""

from __future__ import annotations

import pytest

from specheads.inference.proposers.medusa import MEDUSA_TREES
from specheads.static_trees import (
    TYPICAL_ACCURACIES,
    build_static_tree,
    expected_accept_length,
    resolve_tree,
    validate_tree,
)

# Head 0: top-1 0.5, top-2 0.3; head 1: top-1 0.9, top-2 0.05.
HAND = [[0.5, 0.3], [0.9, 0.05]]


def test_greedy_picks_highest_value_paths():
    # Values: [0]=.5 [1]=.3 [0,0]=.45 [1,0]=.27 [0,1]=.025 [1,1]=.015
    assert build_static_tree(HAND, 1) == [[0]]
    assert build_static_tree(HAND, 2) == [[0], [0, 0]]
    assert build_static_tree(HAND, 3) == [[0], [1], [0, 0]]
    assert build_static_tree(HAND, 4) == [[0], [1], [0, 0], [1, 0]]
    assert build_static_tree(HAND, 6) == [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1]]


def test_greedy_tree_maximises_expected_length_among_closed_trees():
    # With value-ordered growth every greedy tree is the best parent-closed tree of its size.
    for n in range(1, 7):
        tree = build_static_tree(HAND, n)
        assert expected_accept_length(tree, HAND) == pytest.approx(1 + sum(sorted(
            [0.5, 0.3, 0.45, 0.27, 0.025, 0.015], reverse=True)[:n]))


def test_deep_tree_is_parent_closed_and_sorted():
    tree = build_static_tree(TYPICAL_ACCURACIES, 63)
    assert len(tree) == 63
    assert tree == sorted(tree, key=lambda p: (len(p), p))
    paths = {tuple(p) for p in tree}
    assert all(len(p) == 1 or tuple(p[:-1]) in paths for p in tree)


def test_expected_accept_length_of_a_chain():
    assert expected_accept_length([[0], [0, 0]], HAND) == pytest.approx(1 + 0.5 + 0.45)
    with pytest.raises(ValueError, match="beyond the accuracies"):
        expected_accept_length([[0], [0, 0], [0, 0, 0]], HAND)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="num_nodes"):
        build_static_tree(HAND, 7)
    with pytest.raises(ValueError, match=r"\[0, 1\] has no parent \[0\]"):
        validate_tree([[1], [0, 1]])
    with pytest.raises(ValueError, match="twice"):
        validate_tree([[0], [0]])
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        build_static_tree([[1.5]], 1)


@pytest.mark.parametrize("name", sorted(MEDUSA_TREES))
def test_presets_are_valid(name):
    tree = MEDUSA_TREES[name]
    assert validate_tree(tree) == tree
    assert max(len(p) for p in tree) <= len(TYPICAL_ACCURACIES)
    assert expected_accept_length(tree, TYPICAL_ACCURACIES) > 1.5


def test_bigger_presets_expect_longer_acceptance():
    taus = [expected_accept_length(MEDUSA_TREES[f"medusa-{n}"], TYPICAL_ACCURACIES) for n in (16, 32, 63)]
    assert taus == sorted(taus) and len(MEDUSA_TREES["medusa-63"]) == 63


def test_resolve_tree_from_preset_list_and_files(tmp_path):
    assert resolve_tree("chain-4", MEDUSA_TREES) == [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]
    assert resolve_tree([[0, 0], [0]]) == [[0], [0, 0]]
    (tmp_path / "t.json").write_text("[[0], [1], [0, 0]]")
    assert resolve_tree(str(tmp_path / "t.json")) == [[0], [1], [0, 0]]
    (tmp_path / "t.yaml").write_text("tree:\n  - [0]\n  - [0, 1]\n")
    assert resolve_tree(tmp_path / "t.yaml") == [[0], [0, 1]]
    (tmp_path / "bad.yaml").write_text("- [0, 1]\n")
    with pytest.raises(ValueError, match="bad.yaml.*no parent"):
        resolve_tree(str(tmp_path / "bad.yaml"))
    with pytest.raises(ValueError, match="unknown tree 'medusa-7'.*chain-4"):
        resolve_tree("medusa-7", MEDUSA_TREES)
