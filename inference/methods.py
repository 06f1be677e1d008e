"""Method names -> proposers: the one place that knows which proposer backs `--method`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from transformers import PreTrainedModel

from specheads.inference.proposers.base import AutoregressiveProposer, Proposer
from specheads.inference.proposers.draft_model import (
    DraftConfig,
    DraftModelProposer,
    early_exit_model,
    vocab_size,
)
from specheads.inference.proposers.lookup import DEFAULT_LOOKUP, WithPromptLookup
from specheads.inference.proposers.ngram import NgramConfig, NgramProposer


@dataclass(frozen=True)
class MethodOptions:
    draft: str | None = None  # draft model path / id, or "early-exit:N"
    heads: str | None = None  # trained heads folder (medusa, eagle)
    tree: str | None = None  # medusa: tree preset or file; eagle: tree preset (EAGLE_TREES)
    topk: int | None = None  # eagle: children per expanded node
    total_tokens: int | None = None  # eagle: tree size including the root
    min_expected: float | None = None  # eagle: plain step when the draft expects fewer accepted tokens
    depth: int | None = None  # draft depth (proposer default when None)
    width: int | None = None  # branches at the root for `draft`, candidates for `ngram`
    lookup: int | None = None  # eagle, medusa: prompt-lookup continuations grafted onto the tree (0: none)
    device: str = "cpu"
    dtype: str = "auto"


HEADS_METHODS = ("eagle", "medusa")  # methods drafting a tree from trained heads (tree presets, --lookup)


# Loads a draft model and checks it shares the target's vocabulary; injected so this module needs no target I/O.
DraftLoader = Callable[[str], PreTrainedModel]


def _ar(target: PreTrainedModel, opts: MethodOptions, load_draft: DraftLoader) -> Proposer:
    return AutoregressiveProposer()


def _ngram(target: PreTrainedModel, opts: MethodOptions, load_draft: DraftLoader) -> Proposer:
    cfg = NgramConfig()
    overrides = {}
    if opts.depth is not None:
        overrides["depth"] = opts.depth
    if opts.width is not None:
        overrides["num_candidates"] = opts.width
    return NgramProposer(NgramConfig(**{**cfg.__dict__, **overrides}))


def _draft(target: PreTrainedModel, opts: MethodOptions, load_draft: DraftLoader) -> Proposer:
    if not opts.draft:
        raise ValueError("method 'draft' needs --draft PATH (a causal LM with the target's vocabulary) or --draft early-exit:N")
    if opts.draft.startswith("early-exit:"):
        n = opts.draft.split(":", 1)[1]
        if not n.isdigit():
            raise ValueError(f"--draft {opts.draft}: N must be a layer count, e.g. early-exit:8")
        model = early_exit_model(target, int(n))
    else:
        model = load_draft(opts.draft)
    cfg = DraftConfig(depth=opts.depth or DraftConfig.depth, width=opts.width or DraftConfig.width)
    return DraftModelProposer(model, cfg, target_vocab_size=vocab_size(target))


def _eagle(target: PreTrainedModel, opts: MethodOptions, load_draft: DraftLoader) -> Proposer:
    from specheads.heads.eagle import EagleHead
    from specheads.inference.proposers.eagle import EagleProposer, EagleTreeConfig, eagle_tree

    if not opts.heads:
        raise ValueError("method 'eagle' needs --heads DIR (the final/ folder of an eagle training run)")
    base = eagle_tree(opts.tree)  # before loading, so a bad name costs nothing
    lookup = _lookup(opts)
    head = EagleHead.from_pretrained(opts.heads, target)
    tree = EagleTreeConfig(depth=opts.depth or base.depth, topk=opts.topk or base.topk,
                           total_tokens=opts.total_tokens or base.total_tokens,
                           min_expected_accepted=opts.min_expected if opts.min_expected is not None
                           else base.min_expected_accepted)
    return _with_lookup(EagleProposer(head, tree), lookup)


def _medusa(target: PreTrainedModel, opts: MethodOptions, load_draft: DraftLoader) -> Proposer:
    from specheads.inference.proposers.medusa import load_medusa_proposer

    if not opts.heads:
        raise ValueError("method 'medusa' needs --heads DIR (the final/ folder of a medusa training run)")
    lookup = _lookup(opts)
    return _with_lookup(load_medusa_proposer(opts.heads, target, tree=opts.tree, max_depth=opts.depth), lookup)


def _lookup(opts: MethodOptions) -> NgramConfig | None:
    """The prompt lookup grafted onto heads' trees: DEFAULT_LOOKUP unless --lookup says otherwise (0: none)."""
    n = DEFAULT_LOOKUP.num_candidates if opts.lookup is None else opts.lookup
    if n < 0:
        raise ValueError(f"--lookup must be >= 0 (prompt-lookup continuations grafted onto the tree; 0 turns it off), got {n}")
    return replace(DEFAULT_LOOKUP, num_candidates=n, max_nodes=n * DEFAULT_LOOKUP.depth) if n else None


def _with_lookup(proposer: Proposer, lookup: NgramConfig | None) -> Proposer:
    return proposer if lookup is None else WithPromptLookup(proposer, lookup)


METHODS: dict[str, Callable[[PreTrainedModel, MethodOptions, DraftLoader], Proposer]] = {
    "ar": _ar,
    "ngram": _ngram,
    "draft": _draft,
    "eagle": _eagle,
    "medusa": _medusa,
}


def check_same_vocabulary(target: PreTrainedModel, target_tokenizer, draft: PreTrainedModel, draft_tokenizer) -> None:
    """A draft must map token ids to the same strings as the target, or its guesses mean nothing."""
    if vocab_size(draft) != vocab_size(target):
        raise ValueError(
            f"the draft model's vocabulary has {vocab_size(draft)} tokens but the target's has {vocab_size(target)}; "
            "use a draft model from the target's family (same tokenizer)"
        )
    if target_tokenizer is not None and draft_tokenizer is not None and target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError("the draft model's tokenizer differs from the target's (same size, different tokens); "
                         "use a draft model from the target's family")


def make_proposer(method: str, target: PreTrainedModel, opts: MethodOptions, load_draft: DraftLoader) -> Proposer:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of: {', '.join(METHODS)}")
    return METHODS[method](target, opts, load_draft)
