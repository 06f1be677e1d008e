"""The EAGLE head: its draft vocabulary lives in its config and survives a save/load roundtrip."""

from __future__ import annotations

import json

import pytest
import torch

from specheads.formats.load import load_heads
from specheads.heads.checkpoint import CONFIG_NAME, TargetInfo, save_drafter
from specheads.heads.eagle import EagleConfig, EagleHead
from tests.conftest import tiny_model


@pytest.fixture
def target():
    return tiny_model("llama", seed=0)


def _head(target, draft_vocab=None):
    torch.manual_seed(1)
    vocab, hidden = target.get_output_embeddings().weight.shape
    return EagleHead(EagleConfig(hidden_size=hidden, vocab_size=vocab, draft_vocab=draft_vocab), target)


def test_draft_vocab_roundtrip_gives_the_same_draft_logits_and_token_ids(tmp_path, target):
    ids = (3, 7, 8, 40, 95)
    head = _head(target, draft_vocab=ids)
    assert torch.equal(head.draft_weight(), target.get_output_embeddings().weight[list(ids)])
    assert head.token_ids(torch.tensor([0, 4, 2])).tolist() == [3, 95, 8]
    save_drafter(tmp_path / "h", head, TargetInfo.from_model(target, "tiny"))
    saved = json.loads((tmp_path / "h" / CONFIG_NAME).read_text())
    assert saved["config"]["draft_vocab"] == list(ids)

    loaded = load_heads(tmp_path / "h", target, kind="eagle")
    assert loaded.config.draft_vocab == ids
    tokens, feats = torch.randint(0, 96, (1, 6)), torch.randn(1, 6, head.config.hidden_size)
    positions = torch.arange(6)[None]
    with torch.no_grad():
        want = head.eval()(tokens, feats, positions) @ head.draft_weight().T
        got = loaded(tokens, feats, positions) @ loaded.draft_weight().T
    assert want.shape[-1] == len(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_without_a_draft_vocab_the_head_scores_every_token(target):
    head = _head(target)
    assert head.draft_ids is None and head.draft_weight() is target.get_output_embeddings().weight
    assert head.token_ids(torch.tensor([5])).tolist() == [5]


@pytest.mark.parametrize("ids", [(), (5, 3), (1, 1), (-1, 2), (2, 96)])
def test_a_bad_draft_vocab_is_refused(target, ids):
    with pytest.raises(ValueError, match=r"eagle draft_vocab must be sorted, distinct token ids in \[0, 96\)"):
        _head(target, draft_vocab=ids)


def _aux_head(target, aux_layers):
    torch.manual_seed(1)
    vocab, hidden = target.get_output_embeddings().weight.shape
    return EagleHead(EagleConfig(hidden_size=hidden, vocab_size=vocab, aux_layers=aux_layers), target)


def test_aux_layers_head_starts_as_eagle1_and_reads_hidden_states_in_order(target):
    plain, fused = _head(target), _aux_head(target, (1, 2))
    missing, unexpected = fused.load_state_dict(plain.state_dict(), strict=False)  # the same weights but `fuse`
    assert missing == ["fuse.weight"] and not unexpected
    assert fused.feature_width == 3 * fused.config.hidden_size
    hidden_states = tuple(torch.randn(1, 6, fused.config.hidden_size) for _ in range(5))  # embeddings + 4 layers
    feats = fused.select_features(hidden_states)
    assert torch.equal(feats, torch.cat([hidden_states[1], hidden_states[2], hidden_states[4]], dim=-1))
    assert torch.equal(plain.select_features(hidden_states), hidden_states[4])
    tokens, positions = torch.randint(0, 96, (1, 6)), torch.arange(6)[None]
    with torch.no_grad():
        want = plain.eval()(tokens, hidden_states[4], positions)
        got = fused.eval()(tokens, feats, positions)
    torch.testing.assert_close(got, want)  # aux weights start at zero: same output as EAGLE-1
    with torch.no_grad():
        fused.fuse.weight[:, :8].normal_()
        moved = fused(tokens, feats, positions)
    assert not torch.allclose(moved, want)  # and once trained, the aux layers do reach the output


def test_aux_layers_roundtrip(tmp_path, target):
    head = _aux_head(target, (1, 3))
    with torch.no_grad():
        head.fuse.weight.normal_(std=0.1)
    save_drafter(tmp_path / "h", head, TargetInfo.from_model(target, "tiny"))
    loaded = load_heads(tmp_path / "h", target, kind="eagle")
    assert loaded.config.aux_layers == (1, 3)
    tokens, positions = torch.randint(0, 96, (1, 5)), torch.arange(5)[None]
    feats = torch.randn(1, 5, head.feature_width)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens, feats, positions), head.eval()(tokens, feats, positions),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("aux", [(0,), (4,), (2, 1), (1, 1)])
def test_bad_aux_layers_are_refused(target, aux):
    with pytest.raises(ValueError, match=r"aux_layers must be sorted, distinct hidden_states indices in \[1, 3\]"):
        _aux_head(target, aux)
