"""`eagle`: EAGLE heads drafting an EAGLE-2 dynamic tree.

The head keeps its own KV cache over (feature, next token) pairs of the committed
text, fed with the *target's* features after each verification. Each step:

1. Catch up: feed the pairs the last verification produced, (F_path[i], token after
   it), in one forward; the last output predicts the feature of the root, and its
   logits give the depth-1 candidates.
2. Expand: at every depth take the `topk` highest-scoring nodes of the newest level
   (score = cumulative draft log-probability), feed them as (parent's predicted
   feature, node token) pairs with a tree mask, and give each its `topk` children. With a node
   budget, stop once no open node scores above the weakest node the budget kept lately.
3. Rerank: keep the `total_tokens - 1` best nodes by score (ancestor-closed, since a
   child never scores above its parent), in breadth-first order.
4. Roll the head cache back to the committed pairs: drafted entries never survive.
5. Optionally fall back to a plain step when the draft itself expects too little to be accepted.

Drafts are deterministic top-k choices, so verification is exact for greedy and
sampling alike (the verifier treats each draft as one-hot).
"""

from __future__ import annotations

import copy
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
from specheads.inference.node_budget import node_budget
from specheads.inference.proposers.base import ProposalContext, Proposer
from specheads.inference.proposers.lookup import HeadsOptions, with_heads_options
from specheads.inference.tree import DraftTree
from specheads.inference.verifier import VerifyResult
from specheads.int8 import quantize_linears


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
                 vocab: DraftScorer | None = None, int8_vocab: bool = False,
                 stop_below: Callable[[], float] | None = None) -> None:
        """`head` is an EAGLE head or any module drafting the same way (`forward(tokens, features, positions, mask,
        cache)`, `select_features`, `layer_config`, `fc`). `vocab` scores its outputs; by default the target's LM
        head over the head's draft vocabulary (in int8 with `int8_vocab`), plus (with `context_vocab`) the request's
        own tokens outside it. `stop_below()` (e.g. `NodeBudget.stop_below`): stop expanding once no open node's
        draft probability reaches it, since no deeper node would be verified."""
        self.head = head.eval()
        self.config = config
        self.stop_below = stop_below
        first = next(head.parameters())  # an int8 head keeps its norms in its activations' dtype
        self.device, self.dtype = first.device, first.dtype
        self.vocab = vocab if vocab is not None else ContextVocabulary(head.lm_head.weight.detach(), head.draft_ids,
                                                                       enabled=context_vocab, int8=int8_vocab)
        self._cache: TreeKVCache | None = None
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # target features [m, D], tokens [m]
        self._n_pairs = 0  # committed (feature, token) pairs in the head cache

    # -- engine hooks ---------------------------------------------------------------------------

    def fork(self) -> EagleProposer:
        """The same head for another sequence: its own head cache and request vocabulary."""
        new = copy.copy(self)
        new.vocab = self.vocab.fork() if hasattr(self.vocab, "fork") else self.vocab
        new._cache, new._pending, new._n_pairs = None, None, 0
        return new

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
        cache = self._cache
        feats, toks = self._pending
        self._pending = None
        m = toks.shape[0]
        start = self._n_pairs
        positions = torch.arange(start, start + m, device=self.device)
        mask = _block_causal_mask(start, m, feats.dtype, self.device)
        out = self.head(toks[None], feats[None].to(self.dtype), positions[None], mask, cache)[0]
        self._n_pairs = start + m
        committed = self._n_pairs  # the root's children sit at position `committed`
        tree = self._expand(out[-1], root, committed, depth)
        cache.truncate(committed)
        return tree

    def _expand(self, root_hidden: torch.Tensor, root: int, committed: int, depth: int) -> DraftTree:
        """Steps 2-3 on tensors: one head forward per level, no Python loop over nodes.

        Candidates are numbered in creation order: level 1 holds the root's `topk` children, every later
        level `topk` children of each of its `topk` expanded parents. Scores (cumulative draft log-probability)
        add up in float64, so rankings are those of exact sums. Ties go to the earlier candidate everywhere.
        """
        cfg, k, dev = self.config, self.config.topk, self.device
        logp = self._draft_logprobs(root_hidden[None])  # [1, C]: children of the root
        top = logp.topk(k, dim=-1)
        tokens = [self.vocab.token_ids(top.indices[0])]  # per level: [n_d] candidate tokens
        scores = [top.values[0].double()]  # per level: [n_d] cumulative log-probabilities
        parents = [torch.zeros(k, dtype=torch.long, device=dev)]  # per level: [n_d] parent candidate (0 = root)
        # Per level: which fed row predicts each candidate's children (-1: the root, whose pair is committed)
        # and the head output holding that prediction's input feature.
        parent_row = torch.full((k,), -1, dtype=torch.long, device=dev)  # [n_d]
        parent_hidden = root_hidden.expand(k, -1)  # [n_d, H]
        first_id = 1  # candidate number of the level's first node
        seen = torch.zeros(0, 0, dtype=torch.bool, device=dev)  # [F, F]: fed row i sees fed row j (an ancestor or itself)
        below = self.stop_below() if self.stop_below is not None else 0.0
        floor = math.log(below) if below > 0 else None
        for d in range(2, depth + 1):
            level_scores = scores[-1]
            if floor is not None and float(level_scores.max()) < floor:  # one host sync per level, only with a floor
                break
            expand = torch.sort(level_scores, descending=True, stable=True).indices[:k]  # [E]
            e, fed = expand.shape[0], seen.shape[0]
            rows = torch.zeros(e, fed + e, dtype=torch.bool, device=dev)  # what each expanded node sees among fed pairs
            prow = parent_row[expand]
            has_parent = prow >= 0
            rows[has_parent, :fed] = seen[prow[has_parent]]
            rows[:, fed:] = torch.eye(e, dtype=torch.bool, device=dev)
            seen = torch.cat([torch.nn.functional.pad(seen, (0, e)), rows])
            mask = torch.zeros(1, 1, e, committed + fed + e, dtype=parent_hidden.dtype, device=dev)
            mask[0, 0, :, committed:].masked_fill_(~rows, torch.finfo(mask.dtype).min)
            pos = torch.full((1, e), committed + d - 2, device=dev)
            # Feed (predicted feature of the node's parent, node token) for each expanded node.
            h = self.head(tokens[-1][expand][None], parent_hidden[expand][None], pos, mask, self._cache)[0]  # [E, H]
            top = self._draft_logprobs(h).topk(k, dim=-1)  # [E, k]
            tokens.append(self.vocab.token_ids(top.indices).flatten())
            scores.append((level_scores[expand][:, None] + top.values.double()).flatten())
            parents.append((first_id + expand).repeat_interleave(k))
            parent_row = (fed + torch.arange(e, device=dev)).repeat_interleave(k)
            parent_hidden = h.repeat_interleave(k, dim=0)
            first_id += level_scores.shape[0]

        # Rerank: the best total_tokens-1 candidates by score. Candidates are numbered level by level, so the stable
        # sort sends ties to the shallower node; as a child never scores above its parent (log-probabilities are
        # <= 0), the set is ancestor-closed.
        all_scores = torch.cat(scores)  # [M], candidate i+1 at index i
        all_depths = torch.cat([torch.full_like(t, i + 1) for i, t in enumerate(tokens)])
        keep = torch.sort(all_scores, descending=True, stable=True).indices[: cfg.total_tokens - 1]
        if cfg.min_expected_accepted > 0 and float(all_scores[keep].exp().sum()) < cfg.min_expected_accepted:
            return DraftTree.root_only(root)
        # Breadth-first: by depth, then score (keep is already in score order).
        keep = keep[torch.sort(all_depths[keep], stable=True).indices]
        index = torch.full((all_scores.shape[0] + 1,), -1, dtype=torch.long, device=dev)
        index[0] = 0
        index[keep + 1] = torch.arange(1, keep.shape[0] + 1, device=dev)
        nodes = torch.stack([torch.cat(tokens)[keep], index[torch.cat(parents)[keep]]]).cpu()  # [2, K]: one transfer
        probs = all_scores[keep].exp().cpu()  # the draft's own path probability: NodeBudget's estimate
        return DraftTree(tokens=torch.cat([torch.tensor([root]), nodes[0]]),
                         parents=torch.cat([torch.tensor([-1]), nodes[1]]),
                         accept_probs=torch.cat([torch.ones(1, dtype=torch.float64), probs]))


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
    int8 = options.draft_dtype == "int8"
    if int8:
        quantize_linears(head)
    budget = node_budget(target, options.node_budget)
    tree = EagleTreeConfig(depth=options.depth or base.depth, topk=options.topk or base.topk,
                           total_tokens=options.total_tokens or base.total_tokens,
                           min_expected_accepted=base.min_expected_accepted if options.min_expected_accepted is None
                           else options.min_expected_accepted)
    proposer = EagleProposer(head, tree, vocab=scorer(head), int8_vocab=int8,
                             stop_below=budget.stop_below if budget is not None else None)
    return with_heads_options(proposer, target, options, budget)


register_method(Method(
    name=KIND_NAME, summary="EAGLE heads drafting an EAGLE-2 dynamic tree, prompt lookup grafted on",
    options=EagleOptions, build=lambda target, options, load_draft: tree_proposer(target, options, KIND_NAME), arg="heads", arg_hint="DIR", trees=EAGLE_TREES,
))
