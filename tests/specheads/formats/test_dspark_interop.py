"""DSpark drafters against the real `speculators` package (vLLM's format): what we export, its own DSparkDraftModel
loads and drafts with the same logits, Markov bias included, and the same confidence at every block slot; what it
builds and saves, we import, draft with the same logits and decode exactly. Skipped only when speculators is not
installed."""

from __future__ import annotations

import json
from unittest.mock import patch

import pytest
import torch

from specheads.formats.export import export
from specheads.formats.load import load_heads
from specheads.heads.checkpoint import TargetInfo, save_drafter
from specheads.train.block_objective import block_outputs, block_tokens
from tests.drafters import _dspark
from tests.specheads.formats.test_dflash_interop import ANCHORS, BLOCK, MASK, features
from tests.specheads.formats.test_eagle3_interop import AUX, VOCAB, save_peer, target_dir  # noqa: F401
from tests.specheads.formats.test_eagle3_interop import peer as eagle3_peer
from tests.specheads.formats.test_export import assert_decodes_exactly, drafts

speculators = pytest.importorskip("speculators", reason="install with: pip install --no-deps speculators==0.9.0 "
                                                        "hs-connectors==0.9.0 (scripts/setup.sh does)")
pytestmark = pytest.mark.interop

VARIANTS = [{}, {"markov_head_type": "gated"}, {"markov_head_type": "rnn", "sample_from_anchor": False}]
VARIANT_IDS = ["vanilla", "gated", "rnn-anchor-as-bonus"]


def peer(folder):
    from speculators.models.dspark import DSparkSpeculatorConfig

    return eagle3_peer(folder, DSparkSpeculatorConfig)


def both_logits(model, head, tokens, feats, seed=0):
    """The peer's logits (Markov bias added) and confidence logits at every slot of the blocks its own training
    forward anchors, caught where its loss receives them, and ours for the same anchors."""
    import speculators.models.dspark.core as core
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash.utils import select_anchors

    block = head.config.block_size
    loss_mask = torch.ones(tokens.shape)
    torch.manual_seed(seed)
    anchors, _ = select_anchors(loss_mask, ANCHORS, block)
    caught = {}

    def catch(logits, targets, confidence_logits, *args, **kwargs):
        caught["logits"], caught["confidence"] = logits, confidence_logits
        return torch.zeros(()), {}

    torch.manual_seed(seed)  # the same draws inside its forward
    with patch.object(core, "compute_metrics", catch), torch.no_grad():
        model(feats[..., : len(AUX) * 64], tokens, loss_mask, feats[..., len(AUX) * 64 :],
              document_ids=torch.zeros_like(tokens), max_anchors=ANCHORS,
              loss_config=resolve_loss_config("kl_div", "eager"))  # its fused loss needs a GPU compiler
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}
    with torch.no_grad():
        out = block_outputs(head, head, batch, feats, anchors[None])[0]  # [n, B, H]
        logits, confidence = head.block_logits(out, head.previous_tokens(block_tokens(tokens, anchors[None], block)[0]))
    theirs = (caught["logits"].view(ANCHORS, block, -1), caught["confidence"].view(ANCHORS, block))
    return theirs, (logits, confidence)


def export_logits(folder, head, target):
    """The peer's logits and confidences for the export in `folder` and `head`'s, at the blocks it anchors."""
    tokens, feats = features(target)
    return both_logits(peer(folder), head, tokens, feats)


@pytest.mark.parametrize("settings", VARIANTS, ids=VARIANT_IDS)
def test_our_export_loads_in_speculators_and_drafts_the_same_logits(target_dir, tmp_path, settings):  # noqa: F811
    target, target_path = target_dir
    head = _dspark(target, **settings)
    save_drafter(tmp_path / "heads", head, TargetInfo.from_model(target, str(target_path)))
    export(tmp_path / "heads", "speculators", tmp_path / "spec")
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "dspark" and config["architectures"] == ["DSparkSpeculator"]
    assert config["markov_rank"] == 8 and config["markov_head_type"] == settings.get("markov_head_type", "vanilla")
    anchored = settings.get("sample_from_anchor", True)
    assert config["sample_from_anchor"] == anchored
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK - (not anchored)
    theirs, want = export_logits(tmp_path / "spec", head, target)
    torch.testing.assert_close(theirs, want, rtol=1e-5, atol=1e-5)


def _peer_drafter(target_path, folder, **settings):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(target_path)
    layer_config = type(target_config)(**{**target_config.to_dict(), "num_hidden_layers": 2})
    config = DSparkSpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=len(VOCAB), block_size=BLOCK,
        aux_hidden_state_layer_ids=list(AUX), mask_token_id=MASK, markov_rank=8, **settings,
        speculators_config=SpeculatorsConfig(
            algorithm="dspark", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(str(target_path))))
    torch.manual_seed(1)
    save_peer(DSparkDraftModel(config), folder)


@pytest.mark.parametrize("settings", VARIANTS[:2], ids=VARIANT_IDS[:2])
def test_a_drafter_speculators_builds_imports_here_with_the_same_logits_and_decodes_exactly(target_dir, tmp_path,  # noqa: F811
                                                                                            settings):
    target, target_path = target_dir
    _peer_drafter(target_path, tmp_path / "peer", **settings)
    model = peer(tmp_path / "peer")
    head = load_heads(tmp_path / "peer", target, kind="dspark")
    assert head.config.block_size == BLOCK and head.config.mask_token_id == MASK and head.config.draft_vocab == VOCAB
    assert head.config.sample_from_anchor and head.config.markov_rank == 8
    tokens, feats = features(target, seed=2)
    theirs, got = both_logits(model, head, tokens, feats, seed=3)
    torch.testing.assert_close(got, theirs, rtol=1e-5, atol=1e-5)
    assert_decodes_exactly("dspark", target, tmp_path / "peer")


def test_a_draft_vocabulary_out_of_target_order_imports_with_its_bias_rows(target_dir, tmp_path):  # noqa: F811
    # speculators orders a draft vocabulary as it likes (d2t); the LM head's and W2's rows are sorted together
    from safetensors.torch import load_file, save_file

    target, target_path = target_dir
    head = _dspark(target)
    save_drafter(tmp_path / "heads", head, TargetInfo.from_model(target, str(target_path)))
    export(tmp_path / "heads", "speculators", tmp_path / "spec")
    state = load_file(tmp_path / "spec" / "model.safetensors")
    order = torch.randperm(head.config.draft_vocab_size, generator=torch.Generator().manual_seed(0))
    for name in ("lm_head.weight", "markov_head.markov_w2.weight"):
        state[name] = state[name][order]
    ids = torch.tensor(head.config.draft_vocab)[order]
    state["d2t"] = (ids - torch.arange(len(ids))).to(state["d2t"].dtype)
    save_file(state, tmp_path / "spec" / "model.safetensors")
    assert drafts("dspark", target, tmp_path / "spec") == drafts("dspark", target, tmp_path / "heads")
