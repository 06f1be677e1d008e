"""`eagle`: EAGLE heads drafting an EAGLE-2 dynamic tree.

The head keeps its own KV cache over (feature, next token) pairs of the committed
text, fed with the *target's* features after each verification. Each step:

1. Catch up: feed the pairs the last verification produced, (F_path[i], token after
   it), in one forward; the last output predicts the feature of the root, and its
   logits give the depth-1 candidates.
2. Expand: at every depth take the `topk` highest-scoring nodes of the newest level
   (score = cumulative draft log-probability), feed them as (parent's predicted
   feature, node token) pairs with a tree mask, and give each its `topk` children.
3. Rerank: keep the `total_tokens - 1` best nodes by score (ancestor-closed, since a
   child never scores above its parent), in breadth-first order.
4. Roll the head cache back to the committed pairs: drafted entries never survive.
5. Optionally fall back to a plain step when the draft itself expects too little to be accepted.

Drafts are deterministic top-k choices, so verification is exact for greedy and
sampling alike (the verifier treats each draft as one-hot).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from specheads.heads.checkpoint import load_drafter
from specheads.heads.eagle import KIND_NAME
from specheads.inference.cache import TreeKVCache
from specheads.inference.context_vocab import ContextVocabulary
from specheads.inference.methods import Method, option, register_method
from specheads.inference.proposers.base import ProposalContext, Proposer
from specheads.inference.proposers.lookup import HeadsOptions, with_lookup
from specheads.inference.tree import DraftTree
from specheads.inference.verifier import VerifyResult


@dataclass(frozen=True)
class EagleTreeConfig:
    depth: int = 5  # draft levels
    topk: int = 4  # children per expanded node, and nodes expanded per level
    total_tokens: int = 12  # tree size including the root (bounds the verify cost)
    # Draft only when the tree's expected accepted tokens (Σ of node probabilities under the draft) reach this;
    # otherwise take a plain step. Worth it where a multi-token verify costs much more than a one-token step (CPU).
    min_expected_accepted: float = 0.0

    def __post_init__(self) -> None:
        if self.depth < 1 or self.topk < 1 or self.total_tokens < 2:
            raise ValueError("eagle tree needs depth >= 1, topk >= 1 and total_tokens >= 2")


# Named trees (`--tree NAME`, `eagle:DIR@NAME` in bench). τ grows with the tree, and so does the verify
# forward: on a 2-core CPU a 12-node forward costs ~1.6x a one-token step, a 60-node one ~3.5x.
EAGLE_TREES: dict[str, EagleTreeConfig] = {
    "cpu": EagleTreeConfig(),  # the default: depth 5, top-4, 12 nodes
    "wide": EagleTreeConfig(depth=6, topk=8, total_tokens=32),
    "eagle2": EagleTreeConfig(depth=6, topk=10, total_tokens=60),  # EAGLE-2's published GPU setting
}


def eagle_tree(name: str | None) -> EagleTreeConfig:
    """The named tree (None: the default); an unknown name lists the known ones."""
    if name is None:
        return EagleTreeConfig()
    if name not in EAGLE_TREES:
        raise ValueError(f"unknown eagle tree {name!r}; use one of: {', '.join(EAGLE_TREES)} "
                         "(or set --depth/--topk/--total-tokens)")
    return EAGLE_TREES[name]


class DraftScorer(Protocol):
    """Turns a head's outputs into draft logits over the tokens it can draft (e.g. `ContextVocabulary`)."""

    def reset(self, tokens: torch.Tensor) -> None: ...  # a new request whose text so far is `tokens` [T]
    def add(self, tokens: torch.Tensor) -> None: ...  # tokens [n] the request committed
    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [n, H] -> [n, C] fp32
    def token_ids(self, index: torch.Tensor) -> torch.Tensor: ...  # indices into the C columns -> token ids


class EagleProposer:
    needs_target_hidden = True

    def __init__(self, head: nn.Module, config: EagleTreeConfig = EagleTreeConfig(), context_vocab: bool = True,
                 vocab: DraftScorer | None = None) -> None:
        """`head` is an EAGLE head or any module drafting the same way (`forward(tokens, features, positions, mask,
        cache)`, `select_features`, `layer_config`, `fc`). `vocab` scores its outputs; by default the target's LM
        head over the head's draft vocabulary, plus (with `context_vocab`) the request's own tokens outside it."""
        self.head = head.eval()
        self.config = config
        self.device = next(head.parameters()).device
        self.vocab = vocab if vocab is not None else ContextVocabulary(head.lm_head.weight.detach(), head.draft_ids,
                                                                       enabled=context_vocab)
        self._cache: TreeKVCache | None = None
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # target features [m, D], tokens [m]
        self._n_pairs = 0  # committed (feature, token) pairs in the head cache

    # -- engine hooks ---------------------------------------------------------------------------

    def start(self, ctx: ProposalContext, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        self._cache = TreeKVCache(self.head.layer_config, capacity=ctx.tokens.shape[0] + ctx.max_depth + 64)
        self._n_pairs = 0
        self._pending = None
        self.vocab.reset(ctx.tokens)
        if target_hidden is not None:
            feats = self.head.select_features(target_hidden)[0]  # [T-1, D] features of prompt[:-1]
            self._pending = (feats, ctx.tokens[1:].to(self.device))

    def on_verified(self, result: VerifyResult, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        assert target_hidden is not None
        feats = self.head.select_features(target_hidden)[0, result.path.to(target_hidden[-1].device)]  # [A+1, D]
        self.vocab.add(result.tokens)
        toks = result.tokens.to(self.device)
        if self._pending is not None:  # pairs from start() not fed yet: the prefill step drafted nothing
            feats, toks = torch.cat([self._pending[0], feats]), torch.cat([self._pending[1], toks])
        self._pending = (feats, toks)

    # -- drafting -------------------------------------------------------------------------------

    def _draft_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, Vd + E]
        return self.vocab.logits(hidden).log_softmax(-1)

    @torch.inference_mode()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        assert self._cache is not None, "start() must be called before propose()"
        root = int(ctx.tokens[-1])
        depth = min(self.config.depth, ctx.max_depth)
        if self._pending is None or depth < 1:
            return DraftTree.root_only(root)
        cfg = self.config
        cache = self._cache
        feats, toks = self._pending
        self._pending = None
        m = toks.shape[0]
        start = self._n_pairs
        positions = torch.arange(start, start + m, device=self.device)
        mask = _block_causal_mask(start, m, feats.dtype, self.device)
        out = self.head(toks[None], feats[None].to(self.head.fc.weight.dtype), positions[None], mask, cache)[0]
        self._n_pairs = start + m
        committed = self._n_pairs
        root_pos = committed  # the root's children sit at the next position

        # Node 0 is the root; per node: token, parent, score, head output that predicts its children.
        tokens = [root]
        parents = [-1]
        scores = [0.0]
        node_depth = [0]
        logp = self._draft_logprobs(out[-1:])[0]  # children of the root
        top = logp.topk(cfg.topk)
        level = []
        for s, i in zip(top.values.tolist(), self.vocab.token_ids(top.indices).tolist()):
            level.append(len(tokens))
            tokens.append(i)
            parents.append(0)
            scores.append(s)
            node_depth.append(1)
        parent_hidden = {0: out[-1]}  # node -> head output predicting its children
        fed: list[int] = []  # nodes whose pairs sit in the head cache after the committed ones
        for d in range(2, depth + 1):
            expand = heapq.nlargest(cfg.topk, level, key=lambda n: scores[n])
            # Feed (predicted feature of the node's parent, node token) for each expanded node.
            x_feat = torch.stack([parent_hidden[parents[n]] for n in expand])[None]
            x_tok = torch.tensor([tokens[n] for n in expand], device=self.device)[None]
            pos = torch.full((1, len(expand)), root_pos + d - 2, device=self.device)
            mask = self._tree_mask(expand, fed, parents, committed, x_feat.dtype)
            h = self.head(x_tok, x_feat, pos, mask, cache)[0]  # [E, H]
            fed.extend(expand)
            logp = self._draft_logprobs(h)  # [E, Vd]
            top = logp.topk(cfg.topk, dim=-1)
            level = []
            cand_tokens = self.vocab.token_ids(top.indices).tolist()
            for row, n in enumerate(expand):
                parent_hidden[n] = h[row]
                for s, t in zip(top.values[row].tolist(), cand_tokens[row]):
                    level.append(len(tokens))
                    tokens.append(t)
                    parents.append(n)
                    scores.append(scores[n] + s)
                    node_depth.append(d)
        cache.truncate(committed)

        # Rerank: best total_tokens-1 nodes by score, ancestor-closed, then breadth-first order.
        order = sorted(range(1, len(tokens)), key=lambda n: (-scores[n], node_depth[n]))
        keep = {0}
        for n in order:
            if len(keep) >= cfg.total_tokens:
                break
            if parents[n] in keep:
                keep.add(n)
        if cfg.min_expected_accepted > 0:
            expected = sum(math.exp(scores[n]) for n in keep if n)
            if expected < cfg.min_expected_accepted:
                return DraftTree.root_only(root)
        chosen = sorted(keep, key=lambda n: (node_depth[n], -scores[n]))
        index = {n: i for i, n in enumerate(chosen)}
        return DraftTree(
            tokens=torch.tensor([tokens[n] for n in chosen], dtype=torch.long),
            parents=torch.tensor([index[parents[n]] if n else -1 for n in chosen], dtype=torch.long),
        )

    def _tree_mask(self, expand: list[int], fed: list[int], parents: list[int], committed: int,
                   dtype: torch.dtype) -> torch.Tensor:
        """[1, 1, E, committed + len(fed) + E]: committed pairs, the node's fed ancestors, itself."""
        cols = fed + expand
        col_of = {n: i for i, n in enumerate(cols)}
        allowed = torch.zeros(len(expand), len(cols), dtype=torch.bool)
        for r, n in enumerate(expand):
            a = n
            while a > 0:  # the root's own pair is committed, not fed
                if a in col_of:
                    allowed[r, col_of[a]] = True
                a = parents[a]
        mask = torch.zeros(1, 1, len(expand), committed + len(cols), dtype=dtype, device=self.device)
        mask[0, 0, :, committed:].masked_fill_(~allowed.to(self.device), torch.finfo(dtype).min)
        return mask


def _block_causal_mask(prefix: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[1, 1, n, prefix + n]: n new positions see the whole prefix and causally each other."""
    mask = torch.zeros(1, 1, n, prefix + n, dtype=dtype, device=device)
    future = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
    mask[0, 0, :, prefix:].masked_fill_(future, torch.finfo(dtype).min)
    return mask


@dataclass(frozen=True, kw_only=True)
class EagleOptions(HeadsOptions):
    tree: str | None = option(f"named tree: {', '.join(EAGLE_TREES)} (default cpu: depth 5, top-4, 12 nodes; wide 6/8/32; "
                              "eagle2 6/10/60); --depth/--topk/--total-tokens override its fields")
    depth: int | None = option("draft levels")
    topk: int | None = option("children per expanded node")
    total_tokens: int | None = option("tree size including the root")
    min_expected_accepted: float | None = option("take a plain step when the draft expects fewer accepted tokens "
                                                 "(CPU: try 0.7)")

    def __post_init__(self) -> None:
        super().__post_init__()
        eagle_tree(self.tree)  # a bad name fails before anything loads


def tree_proposer(target, options: EagleOptions, kind: str,
                  scorer: Callable[[nn.Module], DraftScorer | None] = lambda head: None) -> Proposer:
    """The `kind` heads in `options.heads` drafting the tree `options` name, prompt lookup grafted on."""
    base = eagle_tree(options.tree)
    head = load_drafter(options.heads, target, kind=kind)
    tree = EagleTreeConfig(depth=options.depth or base.depth, topk=options.topk or base.topk,
                           total_tokens=options.total_tokens or base.total_tokens,
                           min_expected_accepted=base.min_expected_accepted if options.min_expected_accepted is None
                           else options.min_expected_accepted)
    return with_lookup(EagleProposer(head, tree, vocab=scorer(head)), options.lookup)


register_method(Method(
    name=KIND_NAME, summary="EAGLE heads drafting an EAGLE-2 dynamic tree, prompt lookup grafted on",
    options=EagleOptions, build=lambda target, options, load_draft: tree_proposer(target, options, KIND_NAME), arg="heads", arg_hint="DIR", trees=EAGLE_TREES,
))
