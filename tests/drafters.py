"""DRAFTERS: one entry per registered drafter kind, and the checks every kind must pass.

`tests/test_drafters.py` runs every check for every kind in `specheads.kinds.KINDS` (and fails when a
kind has no entry here); `tests/test_toy_kind.py` runs them for a kind registered by a test. An entry
says how to make untrained (perturbed, so they draft) heads of the kind for a tiny target, and which
method options to decode with besides the heads folder.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest.mock import patch

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare
from torch import nn

import specheads.inference.engine.engine as engine_mod
from specheads.formats.load import load_heads
from specheads.heads.checkpoint import CONFIG_NAME, WEIGHTS_NAME, TargetInfo, save_drafter
from specheads.inference import Engine, SamplingParams
from specheads.inference.engine.verifier import VerifyResult
from specheads.inference.methods import METHODS, make_proposer
from specheads.inference.proposers import AutoregressiveProposer, Proposer
from tests.conftest import random_eagle_head, repetitive_prompt, tiny_model


def perturbed(module: nn.Module, scale: float = 0.05, seed: int = 0) -> nn.Module:
    """Fresh heads start as near-copies of the target's next-token predictor; noise makes them draft differently."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g).to(p) * scale)
    return module


def _medusa(target: nn.Module) -> nn.Module:
    from specheads.heads.medusa import MedusaConfig, MedusaHeads

    torch.manual_seed(0)
    config = MedusaConfig.for_target(target, num_heads=4, draft_vocab=tuple(range(3, 80)))
    return perturbed(MedusaHeads.for_target(config, target), scale=0.2)


def _eagle3(target: nn.Module) -> nn.Module:
    from specheads.heads.eagle3 import Eagle3Config, Eagle3Head

    torch.manual_seed(0)
    vocab, hidden = target.get_output_embeddings().weight.shape
    config = Eagle3Config(hidden_size=hidden, vocab_size=vocab, aux_layers=(1, 2, 3), num_layers=2,
                          draft_vocab=tuple(range(3, 80)))
    return perturbed(Eagle3Head(config, target), scale=0.05).to(target.device).eval()


def _peagle(target: nn.Module) -> nn.Module:
    from specheads.heads.peagle import PEagleConfig, PEagleHead

    torch.manual_seed(0)
    vocab, hidden = target.get_output_embeddings().weight.shape
    config = PEagleConfig(hidden_size=hidden, vocab_size=vocab, aux_layers=(1, 2, 3), num_layers=2,
                          draft_vocab=tuple(range(3, 80)), mask_token_id=vocab - 1, num_depths=4)
    return perturbed(PEagleHead(config, target), scale=0.05).to(target.device).eval()


def _dflash(target: nn.Module) -> nn.Module:
    from specheads.heads.dflash import DFlashConfig, DFlashHead

    torch.manual_seed(0)
    vocab, hidden = target.get_output_embeddings().weight.shape
    config = DFlashConfig(hidden_size=hidden, vocab_size=vocab, aux_layers=(1, 2, 3), num_layers=2, block_size=4,
                          draft_vocab=tuple(range(3, 80)), mask_token_id=vocab - 1)
    return perturbed(DFlashHead(config, target), scale=0.05).to(target.device).eval()


def _dspark(target: nn.Module, **settings: Any) -> nn.Module:
    from specheads.heads.dspark import DSparkConfig, DSparkHead

    torch.manual_seed(0)
    vocab, hidden = target.get_output_embeddings().weight.shape
    config = DSparkConfig(hidden_size=hidden, vocab_size=vocab, aux_layers=(1, 2, 3), num_layers=2, block_size=4,
                          draft_vocab=tuple(range(3, 80)), mask_token_id=vocab - 1, markov_rank=8, **settings)
    head = perturbed(DSparkHead(config, target), scale=0.05)
    with torch.no_grad():  # a Markov bias that changes drafts (a fresh one is zero)
        head.markov_head.markov_w2.weight.normal_(std=4.0, generator=torch.Generator().manual_seed(1))
    return head.to(target.device).eval()


def _dflash2(target: nn.Module, **settings: Any) -> nn.Module:
    from specheads.heads.dflash2 import DFlash2Config, DFlash2Head

    torch.manual_seed(0)
    vocab, hidden = target.get_output_embeddings().weight.shape
    config = DFlash2Config(hidden_size=hidden, vocab_size=vocab, aux_layers=(1, 2, 3), num_layers=2, block_size=4,
                           mask_token_id=vocab - 1, selector_rank=8, selector_top_k=6, **settings)
    head = perturbed(DFlash2Head(config, target), scale=0.05)  # the convolutions move off the identity too
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a selector that reorders candidates (a fresh one barely does)
        head.candidate_selector.predecessor_codebook.normal_(std=1.0, generator=g)
        head.candidate_selector.successor_codebook.normal_(std=1.0, generator=g)
        head.candidate_selector.hidden_projection.weight.normal_(std=1.0, generator=g)
    return head.to(target.device).eval()


def _xpress(target: nn.Module, **settings: Any) -> nn.Module:
    from specheads.heads.xpress import XPressConfig, XPressHead

    torch.manual_seed(0)
    vocab, hidden = target.get_output_embeddings().weight.shape
    config = XPressConfig(hidden_size=hidden, vocab_size=vocab, aux_layers=(1, 2, 3), num_layers=2, block_size=4,
                          draft_vocab=tuple(range(3, 80)), mask_token_id=vocab - 1, xpress_rank=8,
                          **{"num_jacobi_passes": 3, **settings})
    head = perturbed(XPressHead(config, target), scale=0.05)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a refiner that changes drafts and mixes the block (a fresh one barely does)
        head.refiner_head.token_embed.weight.normal_(std=1.0, generator=g)
        head.refiner_head.readout.weight.normal_(std=2.0, generator=g)
        head.refiner_head.mix_l.normal_(std=0.5, generator=g)
    return head.to(target.device).eval()


def _domino(target: nn.Module, **settings: Any) -> nn.Module:
    from specheads.heads.domino import DominoConfig, DominoHead

    torch.manual_seed(0)
    vocab, hidden = target.get_output_embeddings().weight.shape
    config = DominoConfig(hidden_size=hidden, vocab_size=vocab, aux_layers=(1, 2, 3), num_layers=2, block_size=4,
                          mask_token_id=vocab - 1, gru_hidden_dim=16, emb_dim=8, **settings)
    head = perturbed(DominoHead(config, target), scale=0.05)
    with torch.no_grad():  # a correction that changes drafts, path by path (a fresh one is zero)
        head.domino_head.embed_proj[2].weight.normal_(std=2.0, generator=torch.Generator().manual_seed(1))
    return head.to(target.device).eval()


@dataclass(frozen=True)
class DrafterCase:
    make: Callable[[nn.Module], nn.Module]  # untrained heads of the kind for a tiny target, on its device
    options: list[dict[str, Any]] = field(default_factory=lambda: [{}])  # decoding options to try (besides heads)


# Every option set decodes with the default node budget; the sampling check decodes whole trees (`node_budget: fixed`).
DRAFTERS: dict[str, DrafterCase] = {
    "eagle": DrafterCase(lambda target: random_eagle_head(target, draft_vocab=tuple(range(3, 80))),
                         [{"lookup": 0}, {}, {"tree": "eagle2", "lookup": 0}, {"draft_dtype": "int8", "lookup": 0}]),
    "eagle3": DrafterCase(_eagle3, [{"lookup": 0}, {}, {"tree": "eagle2", "lookup": 0},
                                    {"draft_dtype": "int8", "lookup": 0}]),
    "peagle": DrafterCase(_peagle, [{"lookup": 0}, {}, {"tree": "eagle2", "lookup": 0}, {"depth": 2, "lookup": 0},
                                    {"draft_dtype": "int8", "lookup": 0}]),
    "dflash": DrafterCase(_dflash, [{"lookup": 0}, {}, {"tree": "eagle2", "lookup": 0}, {"depth": 2, "lookup": 0},
                                    {"draft_dtype": "int8", "lookup": 0}]),
    # a shallower depth: tests/inference/proposers/test_block_proposers.py
    "dspark": DrafterCase(_dspark, [{"lookup": 0}, {}, {"tree": "eagle2", "lookup": 0},
                                    {"draft_dtype": "int8", "lookup": 0}]),
    "dflash2": DrafterCase(_dflash2, [{"lookup": 0}, {}, {"tree": "eagle2", "lookup": 0}, {"depth": 2, "lookup": 0},
                                      {"draft_dtype": "int8", "lookup": 0}]),
    "xpress": DrafterCase(_xpress, [{"lookup": 0}, {}, {"tree": "eagle2", "lookup": 0}, {"depth": 2, "lookup": 0},
                                    {"draft_dtype": "int8", "lookup": 0}]),
    "domino": DrafterCase(_domino, [{"lookup": 0}, {}, {"tree": "eagle2", "lookup": 0}, {"depth": 2, "lookup": 0},
                                    {"draft_dtype": "int8", "lookup": 0}]),
    "medusa": DrafterCase(_medusa, [{"lookup": 0}, {}, {"tree": "medusa-32", "lookup": 0},
                                    {"draft_dtype": "int8", "lookup": 0}]),
}

MAX_NEW = 40


def save_case(kind: str, target: nn.Module, folder: Path) -> nn.Module:
    heads = DRAFTERS[kind].make(target)
    save_drafter(folder, heads, TargetInfo.from_model(target, "tiny"))
    return heads


def proposer_for(kind: str, target: nn.Module, folder: Path, values: dict[str, Any]) -> Proposer:
    """The proposer `--method KIND --heads FOLDER` builds, through the registry and the strict loader."""
    method = METHODS.get(kind)
    return make_proposer(kind, target, method.make_options({method.arg: str(folder), **values}), None)


def check_greedy_equals_plain_greedy(kind: str, target: nn.Module, folder: Path,
                                     options: list[dict[str, Any]] | None = None) -> None:
    """For each of `options` (default: the kind's DRAFTERS options), greedy output equals plain greedy output."""
    save_case(kind, target, folder)
    for seed in (1, 2):
        prompt = repetitive_prompt(seed=seed)
        plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=MAX_NEW)
        for values in DRAFTERS[kind].options if options is None else options:
            res = Engine(target, proposer_for(kind, target, folder, values)).generate(prompt, max_new_tokens=MAX_NEW)
            assert res.output_ids == plain.output_ids, (kind, values)
            assert res.stats.drafted > 0 and res.stats.new_tokens == MAX_NEW, (kind, values)


def check_roundtrip(kind: str, target: nn.Module, folder: Path) -> None:
    heads = save_case(kind, target, folder)
    loaded = load_heads(folder, target, kind=kind)
    assert type(loaded) is type(heads) and loaded.config == heads.config
    want, got = heads.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name].cpu(), got[name].cpu()), name
    saved = json.loads((folder / CONFIG_NAME).read_text())
    assert saved["kind"] == kind and saved["format_version"] == 3


def check_strict_loader(kind: str, target: nn.Module, folder: Path) -> None:
    """Unknown config keys, missing, unexpected and misshapen tensors are refused by name."""
    save_case(kind, target, folder)
    meta, state = json.loads((folder / CONFIG_NAME).read_text()), load_file(folder / WEIGHTS_NAME)

    def refused(message: str, meta_: dict, state_: dict) -> None:
        (folder / CONFIG_NAME).write_text(json.dumps(meta_))
        save_file(state_, folder / WEIGHTS_NAME)
        try:
            load_heads(folder, target)
        except ValueError as err:
            assert message in str(err), (message, str(err))
        else:
            raise AssertionError(f"{kind}: loaded a checkpoint that should be refused ({message})")

    name = sorted(state)[0]
    refused("unknown config key 'bogus'", {**meta, "config": {**meta["config"], "bogus": 1}}, state)
    refused(f"missing tensors [{name!r}]", meta, {k: v for k, v in state.items() if k != name})
    refused("unexpected tensors ['extra.weight']", meta, {**state, "extra.weight": torch.zeros(2)})
    bad = torch.zeros(*state[name].shape[:-1], state[name].shape[-1] + 1)
    refused(f"tensor {name!r} has shape {tuple(bad.shape)} in the file but {tuple(state[name].shape)}", meta,
            {**state, name: bad})


@torch.no_grad()
def bigram_target(arch: str = "llama", scale: float = 0.04, **config: Any) -> nn.Module:
    """A tiny target that mostly continues x with x + 1: every layer's output projections are zeroed (each layer
    passes the residual through), so the logits after x are the LM head applied to x's normed embedding, and row
    j of the LM head is the normed embedding of j - 1. Sampling from it follows counting runs that prompt lookup
    can draft, so speculative sampling accepts draft tokens often."""
    model = tiny_model(arch, **config)  # `config`: tiny_config settings (e.g. vocab)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    normed = model.model.norm(model.model.embed_tokens.weight)  # [V, H]
    model.lm_head.weight.copy_(torch.roll(normed, 1, dims=0) * scale)
    return model


COUNTING_PROMPT = list(range(10, 30)) + list(range(10, 20))  # ends at 19; "17 18 19" was followed by 20, 21, ...


def first_two_tokens(engine: Engine, prompt: list[int], params: SamplingParams, n: int,
                     per_sequence: Callable[[], dict[str, Any]] = dict) -> tuple[Counter, int]:
    """(x1, x2) of `n` generations, each with its own seed (and `Engine.add` arguments from `per_sequence()`, e.g. a
    grammar); and the draft tokens accepted over them.

    The prefill step samples x1 with nothing drafted; the next step drafts from x1 on, so x2 is what the verifier
    committed (an accepted draft token or a residual sample); three tokens leave it room to draft."""
    counts: Counter = Counter()
    accepted = 0
    for start in range(0, n, engine.max_rows):  # with several rows, generations are decoded together
        seqs = [engine.add(prompt, max_new_tokens=3, sampling=SamplingParams(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=seed), **per_sequence())
            for seed in range(start, min(start + engine.max_rows, n))]
        while any(not s.done for s in seqs):
            engine.step()
        for s in seqs:
            counts[tuple(s.output[:2])] += 1
            accepted += s.stats.accepted
    return counts, accepted


@torch.no_grad()
def exact_two_token_law(target: nn.Module, prompt: list[int], params: SamplingParams) -> dict[tuple[int, int], float]:
    """P(x1, x2) = p(x1 | prompt) p(x2 | prompt, x1) under the sampling settings, from the target itself."""
    p1 = params.probs(target(torch.tensor([prompt])).logits[0, -1].float())
    law = {}
    for x1 in p1.nonzero().flatten().tolist():
        p2 = params.probs(target(torch.tensor([prompt + [x1]])).logits[0, -1].float())
        for x2 in p2.nonzero().flatten().tolist():
            law[(x1, x2)] = float(p1[x1] * p2[x2])
    return law


def chi_square_p(counts: Counter, law: dict[tuple[int, int], float]) -> float:
    """p-value of the observed pairs under `law`; cells expecting fewer than 5 draws are pooled into one."""
    if set(counts) - set(law):
        return 0.0  # a pair the target can never produce
    n = sum(counts.values())
    big = [c for c in law if law[c] * n >= 5]
    small = [c for c in law if law[c] * n < 5]
    observed = [counts.get(c, 0) for c in big] + ([sum(counts.get(c, 0) for c in small)] if small else [])
    expected = [law[c] * n for c in big] + ([sum(law[c] for c in small) * n] if small else [])
    expected = np.array(expected) * n / sum(expected)
    return float(chisquare(np.array(observed, dtype=float), expected).pvalue)


SAMPLES = 500
PARAMS = SamplingParams(temperature=1.0, top_k=3)


def _verify_keeping_a_rejected_draft(tree, target_logits, sampling, generator=None):
    """A broken verifier: where the target rejects every child of the root, it keeps the first draft token."""
    res = _real_verify(tree, target_logits, sampling, generator)
    if tree.size > 1 and res.num_accepted == 0:
        bonus = torch.multinomial(sampling.probs(target_logits[1].float()), 1, generator=generator)[0]
        return VerifyResult(path=torch.tensor([0, 1]),
                            tokens=torch.stack([tree.tokens[1], bonus.to(tree.tokens.device)]))
    return res


_real_verify = engine_mod.verify


def check_sampling_preserves_the_target_distribution(kind: str, folder: Path, rows: int = 1) -> None:
    """Chi-square of the first two sampled tokens against the target's exact law (top-3 at temperature 1, 9 cells)
    on a target whose counting runs get drafted and accepted often; a verifier that keeps a rejected draft must
    fail the same test, so the sample size has power. `rows` generations are decoded together."""
    target = bigram_target()
    save_case(kind, target, folder)
    method = METHODS.get(kind)
    options = {"lookup": 1} if method.takes("lookup") else {}  # prompt lookup drafts the counting runs
    if method.takes("node_budget"):
        # Whole trees: two-token generations leave a node budget too few steps to learn that drafts pay here,
        # and the test needs many accepted drafts for its power. Which nodes are verified never matters to the law.
        options["node_budget"] = "fixed"
    check_engine_keeps_the_law(Engine(target, proposer_for(kind, target, folder, options), max_rows=rows), target,
                               label=kind)


def check_engine_keeps_the_law(engine: Engine, target: nn.Module, samples: int = SAMPLES, label: str = "") -> None:
    """`engine`'s first two sampled tokens after COUNTING_PROMPT pass a chi-square test against `target`'s exact law,
    with enough drafts accepted to matter, and fail it under a verifier that keeps a rejected draft (the control)."""
    law = exact_two_token_law(target, COUNTING_PROMPT, PARAMS)
    counts, accepted = first_two_tokens(engine, COUNTING_PROMPT, PARAMS, samples)
    assert accepted > samples // 4, (f"{label}: {accepted} draft tokens accepted in {samples} generations; too few "
                                     "to test")
    assert chi_square_p(counts, law) > 1e-3, (label, counts)
    with patch.object(engine_mod, "verify", _verify_keeping_a_rejected_draft):
        broken, _ = first_two_tokens(engine, COUNTING_PROMPT, PARAMS, samples)
    assert chi_square_p(broken, law) < 1e-6, (label, broken)
