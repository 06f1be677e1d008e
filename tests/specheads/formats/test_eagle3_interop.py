"""EAGLE-3 heads against the real `speculators` package (vLLM's format): what we export, its own
Eagle3DraftModel loads and drafts with the same logits; what it builds and saves, we import, draft with the
same logits and decode exactly. Skipped only when speculators is not installed (the test command installs it)."""

from __future__ import annotations

import json

import pytest
import torch

from specheads.formats.export import export
from specheads.formats.load import load_heads
from specheads.heads.checkpoint import TargetInfo, save_drafter
from specheads.inference import Engine
from specheads.inference.proposers import AutoregressiveProposer
from tests.conftest import repetitive_prompt, tiny_model
from tests.drafters import perturbed, proposer_for

speculators = pytest.importorskip("speculators", reason="install with: pip install --no-deps speculators==0.9.0 "
                                                        "hs-connectors==0.9.0 (scripts/setup.sh does)")
pytestmark = pytest.mark.interop

AUX = (1, 2, 3)
VOCAB = tuple(range(3, 70))


@pytest.fixture
def target_dir(tmp_path):
    target = tiny_model("llama")
    target.save_pretrained(tmp_path / "target")
    return target, tmp_path / "target"


def ours(target, num_layers=1, **flags):
    from specheads.heads.eagle3 import Eagle3Config, Eagle3Head

    torch.manual_seed(0)
    cfg = Eagle3Config(hidden_size=64, vocab_size=96, aux_layers=AUX, num_layers=num_layers, draft_vocab=VOCAB, **flags)
    return perturbed(Eagle3Head(cfg, target), scale=0.05).eval()


def peer(folder, config_class=None):
    """The peer's own model for `folder`, loaded as `config_class` (default: its eagle3 config) says, in eager
    attention."""
    from speculators import SpeculatorModel
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    config = (config_class or Eagle3SpeculatorConfig).from_pretrained(folder)
    config.transformer_layer_config._attn_implementation = "eager"  # flex attention needs a compiler on CPU
    return SpeculatorModel.from_pretrained(folder, config=config).eval()


def save_peer(model, folder) -> None:
    """Give a drafter the peer built its vocabulary mappings (VOCAB) and the verifier's weights, perturb what it
    trains (so it is not the verifier's head), and save it with the peer's own `save_pretrained`."""
    ids = torch.tensor(VOCAB)
    t2d = torch.zeros(96, dtype=torch.bool)
    t2d[ids] = True
    model.load_vocab_mappings(t2d, ids - torch.arange(len(ids)))
    model.load_verifier_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(("embed_tokens", "verifier_")):
                p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)


def inputs(target, length=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, 96, (1, length + 1), generator=g)
    with torch.no_grad():
        hs = target(tokens, output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i] for i in AUX] + [hs[-1]], dim=-1)[:, :-1]  # rows at t pair with token t+1
    return tokens[:, 1:], feats


def peer_logits(model, tokens, feats):
    """The logits of the peer's own forward (first draft step over the whole sequence, causal), over its draft
    vocabulary: caught where its LM head returns them."""
    caught = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: caught.append(out))
    try:
        with torch.no_grad():
            drafted = model(feats[..., : len(AUX) * 64], tokens, document_ids=torch.zeros_like(tokens),
                            position_ids=torch.arange(tokens.shape[1])[None], ttt_steps=1)
    finally:
        hook.remove()
    assert len(caught) == 1 and torch.equal(caught[0].argmax(-1), drafted[0])
    return caught[0]


def export_logits(folder, head, target):
    """The logits speculators' own model for the export in `folder` drafts (its first step over a random sequence,
    caught at its LM head), and `head`'s on the same inputs."""
    tokens, feats = inputs(target)
    with torch.no_grad():
        want = head.draft_logits(head(tokens, feats, torch.arange(tokens.shape[1])[None]))
    return peer_logits(peer(folder), tokens, feats), want


@pytest.mark.parametrize("flags", [{}, {"norm_before_residual": True, "fc_norm": True}], ids=["plain", "norm-options"])
def test_our_export_loads_in_speculators_and_drafts_the_same_logits(target_dir, tmp_path, flags):
    target, target_path = target_dir
    head = ours(target, num_layers=1, **flags)
    save_drafter(tmp_path / "heads", head, TargetInfo.from_model(target, str(target_path)))
    export(tmp_path / "heads", "speculators", tmp_path / "spec")
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target_path)
    model = peer(tmp_path / "spec")
    assert torch.equal(model.d2t + torch.arange(len(VOCAB)), torch.tensor(VOCAB))
    tokens, feats = inputs(target)
    with torch.no_grad():
        want = head.draft_logits(head(tokens, feats, torch.arange(tokens.shape[1])[None]))
    torch.testing.assert_close(peer_logits(model, tokens, feats), want, rtol=1e-5, atol=1e-5)


def test_a_drafter_speculators_builds_imports_here_with_the_same_logits_and_decodes_exactly(target_dir, tmp_path):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.models.eagle3.core import Eagle3DraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    target, target_path = target_dir
    layer_config = type(target.config)(**{**target.config.to_dict(), "num_hidden_layers": 1})
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=len(VOCAB), eagle_aux_hidden_state_layer_ids=list(AUX),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy", verifier=VerifierConfig.from_pretrained(str(target_path))))
    torch.manual_seed(1)
    save_peer(Eagle3DraftModel(config), tmp_path / "peer")
    model = peer(tmp_path / "peer")

    head = load_heads(tmp_path / "peer", target, kind="eagle3")
    assert head.config.draft_vocab == VOCAB and head.config.aux_layers == AUX
    tokens, feats = inputs(target, seed=2)
    with torch.no_grad():
        got = head.draft_logits(head(tokens, feats, torch.arange(tokens.shape[1])[None]))
    torch.testing.assert_close(got, peer_logits(model, tokens, feats), rtol=1e-5, atol=1e-5)

    prompt = repetitive_prompt()
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=32)
    for values in ({"lookup": 0}, {}):
        res = Engine(target,
                     proposer_for("eagle3", target, tmp_path / "peer", values)).generate(prompt, max_new_tokens=32)
        assert res.output_ids == plain.output_ids and res.stats.drafted > 0


def export_with_llama_layers(arch: str, make_head, tmp_path):
    """Heads `make_head(target)` for a tiny `arch` target whose layers do not fit a head, so they have Llama layers
    (specheads.draft_layers), exported to speculators: the export says so and names the target's own architecture
    as the verifier. Returns (target, heads, export folder)."""
    target = tiny_model(arch)
    target.save_pretrained(tmp_path / "target")
    head = make_head(target)
    save_drafter(tmp_path / "heads", head, TargetInfo.from_model(target, str(tmp_path / "target")))
    export(tmp_path / "heads", "speculators", tmp_path / "spec")
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["transformer_layer_config"]["model_type"] == "llama"
    assert config["speculators_config"]["verifier"]["architectures"] == [type(target).__name__]
    return target, head, tmp_path / "spec"


@pytest.mark.parametrize("arch", ["gemma3_text", "phi3"])
def test_heads_with_llama_layers_export_them_and_name_their_own_verifier(tmp_path, arch):
    target, head, folder = export_with_llama_layers(arch, ours, tmp_path)
    theirs, want = export_logits(folder, head, target)
    # the peer's eager attention against the head's SDPA: equal up to fp32 rounding of two kernels
    torch.testing.assert_close(theirs, want, rtol=1e-4, atol=1e-4)
