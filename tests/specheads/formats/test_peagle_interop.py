"""P-EAGLE heads against the real `speculators` package (vLLM's format): what we export, its own PEagleDraftModel
loads and drafts with the same logits at every sampled (anchor, depth) entry; what it builds and saves, we import,
draft with the same logits and decode exactly. Skipped only when speculators is not installed."""

from __future__ import annotations

import json

import pytest
import torch

from specheads.formats.export import export
from specheads.formats.load import load_heads
from specheads.heads.checkpoint import TargetInfo, save_drafter
from specheads.inference import Engine
from specheads.inference.proposers import AutoregressiveProposer
from specheads.train.peagle import block_forward
from tests.conftest import repetitive_prompt
from tests.drafters import perturbed, proposer_for
from tests.specheads.formats.test_eagle3_interop import (  # noqa: F401
    AUX,
    VOCAB,
    export_with_llama_layers,
    inputs,
    save_peer,
    target_dir,
)
from tests.specheads.formats.test_eagle3_interop import peer as eagle3_peer

speculators = pytest.importorskip("speculators", reason="install with: pip install --no-deps speculators==0.9.0 "
                                                        "hs-connectors==0.9.0 (scripts/setup.sh does)")
pytestmark = pytest.mark.interop

DEPTHS = 3
MASK = 95


def ours(target):
    from specheads.heads.peagle import PEagleConfig, PEagleHead

    torch.manual_seed(0)
    cfg = PEagleConfig(hidden_size=64, vocab_size=96, aux_layers=AUX, num_layers=1, draft_vocab=VOCAB,
                       mask_token_id=MASK, num_depths=DEPTHS)
    return perturbed(PEagleHead(cfg, target), scale=0.05).eval()


def peer(folder):
    from speculators.models.peagle import PEagleSpeculatorConfig

    return eagle3_peer(folder, PEagleSpeculatorConfig)


def both_logits(model, head, tokens, feats, seed=0):
    """The peer's logits over every entry its own training forward samples (all of `head`'s depths), caught at its LM
    head, and ours over the same (anchor, depth) entries."""
    from speculators.losses import resolve_loss_config
    from speculators.models.peagle.data import generate_cod_sample_indices

    width, depths = tokens.shape[1], head.config.num_depths
    loss_mask = torch.ones(1, width)
    loss_mask[0, 0] = 0  # its sampler never anchors at position 0
    kwargs = {"num_depths": depths, "down_sample_ratio": 0.8, "down_sample_ratio_min": 0.5}
    torch.manual_seed(seed)
    anchor, depth = generate_cod_sample_indices(width, loss_mask, **kwargs)
    caught = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: caught.append(out))
    torch.manual_seed(seed)  # the same draws inside its forward
    try:
        with torch.no_grad():
            model(feats[..., : len(AUX) * 64], tokens, document_ids=torch.zeros_like(tokens), loss_mask=loss_mask,
                  verifier_last_hidden_states=feats[..., len(AUX) * 64 :],
                  loss_config=resolve_loss_config("kl_div", "eager"), **kwargs)  # its fused loss needs a GPU compiler
    finally:
        hook.remove()
    assert int(depth.max()) == depths - 1  # every depth is compared
    anchors = [anchor[depth == d] for d in range(depths)]
    with torch.no_grad():
        out, got_anchor, got_depth = block_forward(head, head, tokens, feats, anchors)
        want = head.draft_logits(out)
    assert torch.equal(got_anchor, anchor) and torch.equal(got_depth, depth)
    return caught[0], want


def export_logits(folder, head, target):
    """The peer's logits for the export in `folder` and `head`'s, over the entries its training forward samples."""
    tokens, feats = inputs(target, length=12)
    return both_logits(peer(folder), head, tokens, feats)


def test_our_export_loads_in_speculators_and_drafts_the_same_logits(target_dir, tmp_path):  # noqa: F811
    target, target_path = target_dir
    head = ours(target)
    save_drafter(tmp_path / "heads", head, TargetInfo.from_model(target, str(target_path)))
    export(tmp_path / "heads", "speculators", tmp_path / "spec")
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_model_type"] == "peagle" and config["mask_token_id"] == MASK
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == DEPTHS
    model = peer(tmp_path / "spec")
    assert model.mask_token_id == MASK and torch.equal(model.mask_hidden, head.mask_hidden)
    tokens, feats = inputs(target, length=12)
    theirs, want = both_logits(model, head, tokens, feats)
    torch.testing.assert_close(theirs, want, rtol=1e-5, atol=1e-5)


def test_a_drafter_speculators_builds_imports_here_with_the_same_logits_and_decodes_exactly(target_dir, tmp_path):  # noqa: F811
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.peagle import PEagleSpeculatorConfig
    from speculators.models.peagle.core import PEagleDraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    target, target_path = target_dir
    layer_config = type(target.config)(**{**target.config.to_dict(), "num_hidden_layers": 1})
    config = PEagleSpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=len(VOCAB), eagle_aux_hidden_state_layer_ids=list(AUX),
        mask_token_id=MASK, speculators_config=SpeculatorsConfig(
            algorithm="peagle", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=DEPTHS)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(str(target_path))))
    torch.manual_seed(1)
    save_peer(PEagleDraftModel(config), tmp_path / "peer")
    model = peer(tmp_path / "peer")

    head = load_heads(tmp_path / "peer", target, kind="peagle")
    assert head.config.mask_token_id == MASK and head.config.num_depths == DEPTHS and head.config.draft_vocab == VOCAB
    tokens, feats = inputs(target, length=12, seed=2)
    theirs, got = both_logits(model, head, tokens, feats, seed=3)
    torch.testing.assert_close(got, theirs, rtol=1e-5, atol=1e-5)

    prompt = repetitive_prompt()
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=32)
    for values in ({"lookup": 0}, {}):
        res = Engine(target,
                     proposer_for("peagle", target, tmp_path / "peer", values)).generate(prompt, max_new_tokens=32)
        assert res.output_ids == plain.output_ids and res.stats.drafted > 0


def test_an_export_without_a_mask_token_is_refused_by_name(target_dir, tmp_path):  # noqa: F811
    target, target_path = target_dir
    save_drafter(tmp_path / "heads", ours(target), TargetInfo.from_model(target, str(target_path)))
    export(tmp_path / "heads", "speculators", tmp_path / "spec")
    config_path = tmp_path / "spec" / "config.json"
    config = json.loads(config_path.read_text())
    del config["mask_token_id"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="mask_token_id"):
        load_heads(tmp_path / "spec", target, kind="peagle")


def test_an_export_of_heads_with_llama_layers_loads_in_speculators(tmp_path):
    # a Gemma 3 target: the layers are Llama's (specheads.draft_layers), and the export says so
    target, head, folder = export_with_llama_layers("gemma3_text", ours, tmp_path)
    theirs, want = export_logits(folder, head, target)
    # the peer's eager attention against the head's SDPA: equal up to fp32 rounding of two kernels
    torch.testing.assert_close(theirs, want, rtol=1e-4, atol=1e-4)
