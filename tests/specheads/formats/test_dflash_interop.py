"""DFlash drafters against the real `speculators` package (vLLM's format): what we export, its own DFlashDraftModel
loads and drafts with the same logits at every block slot; what it builds and saves, we import, draft with the same
logits and decode exactly; a drafter whose aux layers the target lacks is refused by name. Skipped only when
speculators is not installed."""

from __future__ import annotations

import json

import pytest
import torch

from specheads.formats.export import export
from specheads.formats.load import load_heads
from specheads.heads.checkpoint import TargetInfo, save_drafter
from specheads.inference import Engine
from specheads.inference.proposers import AutoregressiveProposer
from specheads.train.dflash import _blocks
from tests.conftest import repetitive_prompt
from tests.drafters import perturbed, proposer_for
from tests.specheads.formats.test_eagle3_interop import AUX, VOCAB, export_with_llama_layers, save_peer, target_dir  # noqa: F401
from tests.specheads.formats.test_eagle3_interop import peer as eagle3_peer

speculators = pytest.importorskip("speculators", reason="install with: pip install --no-deps speculators==0.9.0 "
                                                        "hs-connectors==0.9.0 (scripts/setup.sh does)")
pytestmark = pytest.mark.interop

BLOCK = 4
MASK = 95
ANCHORS = 5


def ours(target):
    from specheads.heads.dflash import DFlashConfig, DFlashHead

    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=64, vocab_size=96, aux_layers=AUX, num_layers=2, block_size=BLOCK,
                       mask_token_id=MASK, draft_vocab=VOCAB)
    return perturbed(DFlashHead(cfg, target), scale=0.05).eval()


def peer(folder):
    from speculators.models.dflash import DFlashSpeculatorConfig

    return eagle3_peer(folder, DFlashSpeculatorConfig)


def features(target, length=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 90, (1, length), generator=g)
    with torch.no_grad():
        hs = target(tokens, output_hidden_states=True).hidden_states
    return tokens, torch.cat([hs[i] for i in AUX] + [hs[-1]], dim=-1)  # row p: the target's states at p


def both_logits(model, head, tokens, feats, seed=0):
    """The peer's logits at the drafted slots of the blocks its own training forward anchors, caught at its LM head,
    and ours for the same anchors."""
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash.utils import select_anchors

    block = head.config.block_size
    loss_mask = torch.ones(tokens.shape)
    torch.manual_seed(seed)
    anchors, _ = select_anchors(loss_mask, ANCHORS, block)
    caught = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: caught.append(out))
    torch.manual_seed(seed)  # the same draws inside its forward
    try:
        with torch.no_grad():
            model(feats[..., : len(AUX) * 64], tokens, loss_mask, feats[..., len(AUX) * 64 :],
                  document_ids=torch.zeros_like(tokens), max_anchors=ANCHORS,
                  loss_config=resolve_loss_config("kl_div", "eager"))  # its fused loss needs a GPU compiler
    finally:
        hook.remove()
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}
    with torch.no_grad():
        want = head.draft_logits(_blocks(head, head, batch, feats, anchors[None]))  # [1, n, B-1, Vd]
    return caught[0].view(1, ANCHORS, block, -1)[:, :, 1:], want


def export_logits(folder, head, target):
    """The peer's logits for the export in `folder` and `head`'s, at the drafted slots of the blocks it anchors."""
    tokens, feats = features(target)
    return both_logits(peer(folder), head, tokens, feats)


def test_our_export_loads_in_speculators_and_drafts_the_same_logits(target_dir, tmp_path):  # noqa: F811
    target, target_path = target_dir
    head = ours(target)
    save_drafter(tmp_path / "heads", head, TargetInfo.from_model(target, str(target_path)))
    export(tmp_path / "heads", "speculators", tmp_path / "spec")
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == BLOCK
    assert config["mask_token_id"] == MASK and config["aux_hidden_state_layer_ids"] == list(AUX)
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1
    model = peer(tmp_path / "spec")
    tokens, feats = features(target)
    theirs, want = both_logits(model, head, tokens, feats)
    torch.testing.assert_close(theirs, want, rtol=1e-5, atol=1e-5)


def _peer_drafter(target_path, folder):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashSpeculatorConfig
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(target_path)
    layer_config = type(target_config)(**{**target_config.to_dict(), "num_hidden_layers": 2})
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=len(VOCAB), block_size=BLOCK,
        aux_hidden_state_layer_ids=list(AUX), mask_token_id=MASK, speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(str(target_path))))
    torch.manual_seed(1)
    save_peer(DFlashDraftModel(config), folder)


def test_a_drafter_speculators_builds_imports_here_with_the_same_logits_and_decodes_exactly(target_dir, tmp_path):  # noqa: F811
    target, target_path = target_dir
    _peer_drafter(target_path, tmp_path / "peer")
    model = peer(tmp_path / "peer")
    head = load_heads(tmp_path / "peer", target, kind="dflash")
    assert head.config.block_size == BLOCK and head.config.mask_token_id == MASK and head.config.draft_vocab == VOCAB
    tokens, feats = features(target, seed=2)
    theirs, got = both_logits(model, head, tokens, feats, seed=3)
    torch.testing.assert_close(got, theirs, rtol=1e-5, atol=1e-5)

    prompt = repetitive_prompt()
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=32)
    for values in ({"lookup": 0}, {}):
        res = Engine(target,
                     proposer_for("dflash", target, tmp_path / "peer", values)).generate(prompt, max_new_tokens=32)
        assert res.output_ids == plain.output_ids and res.stats.drafted > 0


def test_a_drafter_reading_layers_the_target_lacks_is_refused_by_name(target_dir, tmp_path):  # noqa: F811
    target, target_path = target_dir
    _peer_drafter(target_path, tmp_path / "peer")
    config_path = tmp_path / "peer" / "config.json"
    config = json.loads(config_path.read_text())
    config["aux_hidden_state_layer_ids"] = [1, 2, 30]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"reads target layers \[30\], which a 4-layer target does not have"):
        load_heads(tmp_path / "peer", target, kind="dflash")


def test_an_export_of_a_drafter_with_llama_layers_loads_in_speculators(tmp_path):
    # a Gemma 3 target: the layers are Llama's (specheads.draft_layers), and the export says so
    target, head, folder = export_with_llama_layers("gemma3_text", ours, tmp_path)
    theirs, want = export_logits(folder, head, target)
    # the peer's eager attention against the head's SDPA: equal up to fp32 rounding of two kernels
    torch.testing.assert_close(theirs, want, rtol=1e-4, atol=1e-4)


def test_a_full_vocabulary_drafter_exports_only_with_its_verifiers_head(target_dir, tmp_path):  # noqa: F811
    """speculators loads a full-vocabulary DFlash drafter with its verifier's LM head: an export whose head was trained
    is refused by name; one whose head is the verifier's loads and drafts the same logits there."""
    from specheads.heads.dflash import DFlashConfig, DFlashHead

    target, target_path = target_dir
    torch.manual_seed(0)
    cfg = DFlashConfig(hidden_size=64, vocab_size=96, aux_layers=AUX, num_layers=2, block_size=BLOCK,
                       mask_token_id=MASK)
    head = perturbed(DFlashHead(cfg, target), scale=0.05).eval()
    info = TargetInfo.from_model(target, str(target_path))
    save_drafter(tmp_path / "trained", head, info)
    with pytest.raises(ValueError, match="LM head it trained.*draft_vocab_size"):
        export(tmp_path / "trained", "speculators", tmp_path / "refused")
    assert not (tmp_path / "refused" / "config.json").exists()
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight)
    save_drafter(tmp_path / "verifier-head", head, info)
    export(tmp_path / "verifier-head", "speculators", tmp_path / "spec")
    theirs, want = export_logits(tmp_path / "spec", head, target)
    torch.testing.assert_close(theirs, want, rtol=1e-5, atol=1e-5)
