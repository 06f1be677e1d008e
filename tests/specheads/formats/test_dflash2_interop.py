"""DFlash2 drafters against the real `speculators` package (vLLM's format): what we export, its own DFlash2DraftModel
loads and, on its own training forward, computes the same unary logits at every block slot, the same selector
candidates (the target's argmax put in where the top-k misses it) and the same candidate scores; what it builds and
saves (without an LM head: its verifier's), we import, compute the same and decode exactly. Skipped only when
speculators is not installed."""

from __future__ import annotations

import json
from unittest.mock import patch

import pytest
import torch

from specheads.formats.export import export
from specheads.formats.load import load_heads
from specheads.heads.checkpoint import TargetInfo, save_drafter
from specheads.train.block_objective import block_outputs, block_tokens
from specheads.train.dflash2 import selector_candidates
from tests.drafters import _dflash2
from tests.specheads.formats.test_dflash_interop import ANCHORS, BLOCK, MASK, features
from tests.specheads.formats.test_eagle3_interop import AUX, target_dir  # noqa: F401
from tests.specheads.formats.test_eagle3_interop import peer as eagle3_peer
from tests.specheads.formats.test_export import assert_decodes_exactly

speculators = pytest.importorskip("speculators", reason="install with: pip install --no-deps speculators==0.9.0 "
                                                        "hs-connectors==0.9.0 (scripts/setup.sh does)")
pytestmark = pytest.mark.interop

VARIANTS = [{}, {"sample_from_anchor": True, "conv_kernel_size": 3, "conv_group_size": 8}]
VARIANT_IDS = ["anchor-as-bonus", "from-anchor-3-taps"]


def peer(folder):
    from speculators.models.dflash2 import DFlash2SpeculatorConfig

    return eagle3_peer(folder, DFlash2SpeculatorConfig)


def both_logits(model, head, tokens, feats, seed=0):
    """The peer's unary logits [n, B, V], training candidates [n, B, k] and their scores [n, B, k] at every slot of
    the blocks its own training forward anchors, caught where its loss receives them; and ours for the same anchors
    (our candidates from our logits and the target's argmax, the scores of theirs)."""
    import speculators.models.dflash2.core as core
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash.utils import select_anchors

    block = head.config.block_size
    loss_mask = torch.ones(tokens.shape)
    torch.manual_seed(seed)
    anchors, _ = select_anchors(loss_mask, ANCHORS, block)
    caught = {}

    def catch(**kwargs):
        caught.update(kwargs)
        return torch.zeros(()), {}

    torch.manual_seed(seed)  # the same draws inside its forward
    with patch.object(core, "compute_metrics", catch), torch.no_grad():
        model(feats[..., : len(AUX) * 64], tokens, loss_mask, feats[..., len(AUX) * 64 :],
              document_ids=torch.zeros_like(tokens), max_anchors=ANCHORS,
              loss_config=resolve_loss_config("kl_div", "eager"))  # its fused loss needs a GPU compiler
    shape = (ANCHORS, block, -1)
    theirs = tuple(caught[k].view(shape) for k in ("unary_logits", "training_candidate_ids", "candidate_logits"))
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}
    with torch.no_grad():
        normed = head.norm(block_outputs(head, head, batch, feats, anchors[None])[0])  # [n, B, H]
        unary = head.lm_head(normed)
        label = caught["targets"].view(shape).argmax(-1)  # the target's choice at each slot
        ids, _, _ = selector_candidates(unary.topk(head.config.selector_top_k, -1).indices.flatten(0, 1),
                                        label.flatten())
        prev = head.previous_tokens(block_tokens(tokens, anchors[None], block)[0])
        _, scores = head.candidates(unary, normed, prev, theirs[1])
    return theirs, (unary, ids.view(shape), scores)


def export_logits(folder, head, target):
    """The peer's logits, candidates and scores for the export in `folder` and `head`'s, at the blocks it anchors."""
    tokens, feats = features(target)
    return both_logits(peer(folder), head, tokens, feats)


@pytest.mark.parametrize("settings", VARIANTS, ids=VARIANT_IDS)
def test_our_export_loads_in_speculators_and_drafts_the_same_logits(target_dir, tmp_path, settings):  # noqa: F811
    target, target_path = target_dir
    head = _dflash2(target, **settings)
    save_drafter(tmp_path / "heads", head, TargetInfo.from_model(target, str(target_path)))
    export(tmp_path / "heads", "speculators", tmp_path / "spec")
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash2" and config["architectures"] == ["DFlash2DraftModel"]
    assert (config["selector_rank"], config["selector_top_k"]) == (8, 6)
    assert config["conv_kernel_size"] == settings.get("conv_kernel_size", 2)
    assert config["conv_group_size"] == settings.get("conv_group_size", 16)
    anchored = settings.get("sample_from_anchor", False)
    assert config["sample_from_anchor"] == anchored and config["draft_vocab_size"] == 96
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK - (not anchored)
    theirs, want = export_logits(tmp_path / "spec", head, target)
    torch.testing.assert_close(theirs, want, rtol=1e-5, atol=1e-5)


def _peer_drafter(target_path, folder, **settings):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(target_path)
    layer_config = type(target_config)(**{**target_config.to_dict(), "num_hidden_layers": 2})
    config = DFlash2SpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=target_config.vocab_size, block_size=BLOCK,
        aux_hidden_state_layer_ids=list(AUX), mask_token_id=MASK, selector_rank=8, selector_top_k=6, **settings,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash2", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(str(target_path))))
    torch.manual_seed(1)
    model = DFlash2DraftModel(config)
    model.load_verifier_weights()
    with torch.no_grad():  # what it trains, moved off its start (the convolutions off the identity)
        for name, p in model.named_parameters():
            if p.requires_grad and not name.startswith(("embed_tokens", "verifier_")):
                p.add_(torch.randn_like(p) * (1.0 if name.startswith("candidate_selector") else 0.05))
    model.save_pretrained(folder)


def test_a_drafter_speculators_builds_imports_here_with_the_same_logits_and_decodes_exactly(target_dir, tmp_path):  # noqa: F811
    from safetensors import safe_open

    target, target_path = target_dir
    _peer_drafter(target_path, tmp_path / "peer")
    with safe_open(tmp_path / "peer" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # its verifier's, never saved
    model = peer(tmp_path / "peer")
    head = load_heads(tmp_path / "peer", target, kind="dflash2")
    assert head.config.block_size == BLOCK and head.config.mask_token_id == MASK and head.config.draft_vocab is None
    assert not head.config.sample_from_anchor and (head.config.selector_rank, head.config.selector_top_k) == (8, 6)
    tokens, feats = features(target, seed=2)
    theirs, got = both_logits(model, head, tokens, feats, seed=3)
    torch.testing.assert_close(got, theirs, rtol=1e-5, atol=1e-5)
    assert_decodes_exactly("dflash2", target, tmp_path / "peer")


def test_a_draft_vocabulary_is_refused_by_name(target_dir, tmp_path):  # noqa: F811
    target, target_path = target_dir
    _peer_drafter(target_path, tmp_path / "peer")
    config_path = tmp_path / "peer" / "config.json"
    config = json.loads(config_path.read_text())
    config["draft_vocab_size"] = 64
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"scores 64 tokens of a 96-token vocabulary; dflash2 scores the whole"):
        load_heads(tmp_path / "peer", target, kind="dflash2")
