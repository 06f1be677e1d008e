"""XPress drafters against the real `speculators` package (vLLM's format): what we export, its own XPressDraftModel
loads and, on its own training forward, computes the same logits at every block slot as ours: teacher forced, after
each of its Jacobi consistency passes, and without the refiner's bias; what it builds and saves, we import, draft
with the same logits and decode exactly. Skipped only when speculators is not installed."""

from __future__ import annotations

import json
from unittest.mock import patch

import pytest
import torch

from specheads.formats.export import export
from specheads.formats.load import load_heads
from specheads.heads.checkpoint import TargetInfo, save_drafter
from specheads.train.block_objective import BlockStep, block_outputs
from specheads.train.xpress import xpress_blocks
from tests.drafters import _xpress
from tests.specheads.formats.test_dflash_interop import ANCHORS, BLOCK, MASK, features
from tests.specheads.formats.test_eagle3_interop import AUX, VOCAB, save_peer, target_dir  # noqa: F401
from tests.specheads.formats.test_eagle3_interop import peer as eagle3_peer
from tests.specheads.formats.test_export import assert_decodes_exactly, drafts

speculators = pytest.importorskip("speculators", reason="install with: pip install --no-deps speculators==0.9.0 "
                                                        "hs-connectors==0.9.0 (scripts/setup.sh does)")
pytestmark = pytest.mark.interop

PASSES = 3  # the peer's consistency rounds (its default)
VARIANTS = [{}, {"sample_from_anchor": True}, {"xpress_mlp_ratio": 4, "num_jacobi_passes": 5}]
VARIANT_IDS = ["anchor-as-bonus", "from-anchor", "mlp-ratio-4"]


def peer(folder):
    """The peer's own model for `folder`, its refiner's causal mask restored: speculators 0.9.0 keeps that mask in a
    buffer it does not save, and its `from_pretrained` (transformers 5, built on the meta device) leaves it
    uninitialised memory, so the peer's loaded model would mix its block through garbage."""
    from speculators.models.xpress import XPressSpeculatorConfig

    model = eagle3_peer(folder, XPressSpeculatorConfig)
    tril = model.refiner_head.causal_tril
    model.refiner_head.causal_tril = torch.tril(torch.ones_like(tril))
    return model


def both_logits(model, head, tokens, feats, seed=0):
    """The peer's logits at every slot of the blocks its own training forward anchors (teacher forced, each
    consistency pass, without the bias), caught where its loss receives them, and ours for the same anchors."""
    import speculators.models.xpress.core as core
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash.utils import select_anchors

    block = head.config.block_size
    loss_mask = torch.ones(tokens.shape)
    torch.manual_seed(seed)
    anchors, _ = select_anchors(loss_mask, ANCHORS, block)
    caught = {}

    def catch(logits_tf, round_logits, base_logits, *args, **kwargs):
        caught["tf"], caught["rounds"], caught["base"] = logits_tf, round_logits, base_logits
        return torch.zeros(()), {}

    torch.manual_seed(seed)  # the same draws inside its forward
    with patch.object(core, "compute_metrics", catch), torch.no_grad():
        model(feats[..., : len(AUX) * 64], tokens, loss_mask, feats[..., len(AUX) * 64 :],
              document_ids=torch.zeros_like(tokens), max_anchors=ANCHORS, consistency_passes=PASSES,
              loss_config=resolve_loss_config("kl_div", "eager"))  # its fused loss needs a GPU compiler
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}
    with torch.no_grad():
        out = block_outputs(head, head, batch, feats, anchors[None])  # [1, n, B, H]
        step = BlockStep(head, anchors[None], out, torch.ones(1, ANCHORS, head.config.drafted, dtype=torch.bool),
                         torch.zeros(0))
        ours = xpress_blocks(step, tokens, PASSES)
    shape = (1, ANCHORS, block, -1)
    theirs = [caught["tf"].view(shape), *(r.view(shape) for r in caught["rounds"]), caught["base"].view(shape)]
    return theirs, [ours.teacher_forced, *ours.passes, ours.base]


def export_logits(folder, head, target):
    """The peer's logits for the export in `folder` and `head`'s, at the blocks it anchors."""
    tokens, feats = features(target)
    return both_logits(peer(folder), head, tokens, feats)


@pytest.mark.parametrize("settings", VARIANTS, ids=VARIANT_IDS)
def test_our_export_loads_in_speculators_and_computes_the_same_logits(target_dir, tmp_path, settings):  # noqa: F811
    target, target_path = target_dir
    head = _xpress(target, **settings)
    save_drafter(tmp_path / "heads", head, TargetInfo.from_model(target, str(target_path)))
    export(tmp_path / "heads", "speculators", tmp_path / "spec")
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "xpress" and config["architectures"] == ["XPressSpeculator"]
    assert config["xpress_rank"] == 8 and config["xpress_mlp_ratio"] == settings.get("xpress_mlp_ratio", 2)
    assert config["num_jacobi_passes"] == settings.get("num_jacobi_passes", 3)
    anchored = settings.get("sample_from_anchor", False)
    assert config["sample_from_anchor"] == anchored
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK - (not anchored)
    theirs, want = export_logits(tmp_path / "spec", head, target)
    assert len(theirs) == PASSES + 2
    torch.testing.assert_close(theirs, want, rtol=1e-5, atol=1e-5)


def _peer_drafter(target_path, folder, **settings):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.xpress import XPressDraftModel, XPressSpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(target_path)
    layer_config = type(target_config)(**{**target_config.to_dict(), "num_hidden_layers": 2})
    config = XPressSpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=len(VOCAB), block_size=BLOCK,
        aux_hidden_state_layer_ids=list(AUX), mask_token_id=MASK, xpress_rank=8, num_jacobi_passes=2, **settings,
        speculators_config=SpeculatorsConfig(
            algorithm="xpress", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(str(target_path))))
    torch.manual_seed(1)
    model = XPressDraftModel(config)
    with torch.no_grad():  # a refiner that moves the drafts (the peer starts its mixer at zero)
        model.refiner_head.mix_l.normal_(std=0.5)
        model.refiner_head.readout.weight.normal_(std=1.0)
    save_peer(model, folder)


def test_a_drafter_speculators_builds_imports_here_with_the_same_logits_and_decodes_exactly(target_dir, tmp_path):  # noqa: F811
    target, target_path = target_dir
    _peer_drafter(target_path, tmp_path / "peer")
    model = peer(tmp_path / "peer")
    head = load_heads(tmp_path / "peer", target, kind="xpress")
    assert head.config.block_size == BLOCK and head.config.mask_token_id == MASK and head.config.draft_vocab == VOCAB
    assert not head.config.sample_from_anchor and head.config.xpress_rank == 8 and head.config.num_jacobi_passes == 2
    tokens, feats = features(target, seed=2)
    theirs, got = both_logits(model, head, tokens, feats, seed=3)
    torch.testing.assert_close(got, theirs, rtol=1e-5, atol=1e-5)
    assert_decodes_exactly("xpress", target, tmp_path / "peer")


def test_a_draft_vocabulary_out_of_target_order_imports_with_its_readout_rows(target_dir, tmp_path):  # noqa: F811
    # speculators orders a draft vocabulary as it likes (d2t); the LM head's and the readout's rows are sorted together
    from safetensors.torch import load_file, save_file

    target, target_path = target_dir
    head = _xpress(target)
    save_drafter(tmp_path / "heads", head, TargetInfo.from_model(target, str(target_path)))
    export(tmp_path / "heads", "speculators", tmp_path / "spec")
    state = load_file(tmp_path / "spec" / "model.safetensors")
    order = torch.randperm(head.config.draft_vocab_size, generator=torch.Generator().manual_seed(0))
    for name in ("lm_head.weight", "refiner_head.readout.weight"):
        state[name] = state[name][order]
    ids = torch.tensor(head.config.draft_vocab)[order]
    state["d2t"] = (ids - torch.arange(len(ids))).to(state["d2t"].dtype)
    save_file(state, tmp_path / "spec" / "model.safetensors")
    assert drafts("xpress", target, tmp_path / "spec") == drafts("xpress", target, tmp_path / "heads")
