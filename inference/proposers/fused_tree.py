"""Fused-head tree drafting: a head that reads the target's features and keeps its own KV cache drafts an EAGLE-2
dynamic tree (the `eagle` and `eagle3` methods), or a block per forward (`peagle`, through `draft_group`).

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

A proposer drafting otherwise from the same head cache (a block per forward) overrides `draft_group` and builds on
`catch_up` (step 1, optionally followed by mask entries) and `score_rows` (the rows' draft log-probabilities).
Drafts are deterministic top-k choices, so verification is exact for greedy and
sampling alike (the verifier treats each draft as one-hot).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from torch import nn

from specheads.features import feature_layers
from specheads.formats.load import load_heads
from specheads.inference.engine.batch_cache import BatchKVCache
from specheads.inference.engine.layer_attention import additive_mask
from specheads.inference.engine.proposer import ProposalContext, Proposer
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult
from specheads.inference.methods.tree_options import TreeConfig, TreeOptions, named_tree, tree_config
from specheads.inference.proposers.context_vocab import ContextVocabulary
from specheads.inference.proposers.lookup import with_heads_options
from specheads.inference.proposers.node_budget import node_budget
from specheads.int8 import quantize_linears
from specheads.target_logits import LogitMap


class DraftScorer(Protocol):
    """Turns a head's outputs into draft logits over the tokens it can draft (e.g. `ContextVocabulary`)."""

    def reset(self, tokens: torch.Tensor) -> None: ...  # a new request whose text so far is `tokens` [T]
    def add(self, tokens: torch.Tensor) -> None: ...  # tokens [n] the request committed
    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [n, H] -> [n, C] fp32
    def token_ids(self, index: torch.Tensor) -> torch.Tensor: ...  # indices into the C columns -> token ids


class HeadRows:
    """The head's KV cache for every sequence its proposers (a proposer and its forks) draft for: one row each of a
    `BatchKVCache`, kept contiguous (a released row is refilled by the last one), so rows drafting together run one
    head forward per level over a window of rows."""

    def __init__(self, layer_config) -> None:
        self.layer_config = layer_config
        self.cache: BatchKVCache | None = None
        self.owners: list[FusedTreeProposer] = []  # by row

    def acquire(self, owner: FusedTreeProposer, capacity: int) -> None:
        """Give `owner` an empty row (its own again, if it holds one: a proposer restarted for a new sequence)."""
        if self.cache is None:
            self.cache = BatchKVCache(self.layer_config, rows=4, capacity=capacity, grow_rows=True)
        if owner._row < 0:
            owner._row = self.cache.add_row()
            self.owners.append(owner)
        self.cache.lengths[owner._row] = 0

    def release(self, owner: FusedTreeProposer) -> None:
        if owner._row < 0 or self.cache is None:
            return
        moved = self.cache.remove_row(owner._row)
        last = self.owners.pop()
        if moved is not None:
            self.owners[owner._row] = last
            last._row = owner._row
        owner._row = -1


class FusedTreeProposer:
    needs_target_hidden = True

    def __init__(self, head: nn.Module, config: TreeConfig = TreeConfig(), context_vocab: bool = True,
                 vocab: DraftScorer | None = None, int8_vocab: bool = False,
                 stop_below: Callable[[], float] | None = None) -> None:
        """`head` is an EAGLE head or any module drafting the same way (`forward(tokens, features, positions, mask,
        cache)`, `select_features`, `layer_config`, `fc`). `vocab` scores its outputs; by default the target's LM
        head over the head's draft vocabulary (in int8 with `int8_vocab`), plus (with `context_vocab`) the request's
        own tokens outside it. `stop_below()` (e.g. `NodeBudget.stop_below`): stop expanding once no open node's
        draft probability reaches it, since no deeper node would be verified."""
        self.head = head.eval()
        self.target_layers = feature_layers(head.config.aux_layers)
        self.config = config
        self.stop_below = stop_below
        first = next(head.parameters())  # an int8 head keeps its norms in its activations' dtype
        self.device, self.dtype = first.device, first.dtype
        self.vocab = vocab if vocab is not None else ContextVocabulary(
            head.lm_head.weight.detach(), head.draft_ids, enabled=context_vocab, int8=int8_vocab,
            logit_map=getattr(head, "logit_map", LogitMap()))
        self.head_rows = HeadRows(head.layer_config)  # shared with forks
        self._row = -1  # this sequence's row in it, from `start` to `finish`
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # target features [m, D], tokens [m]

    # -- engine hooks ---------------------------------------------------------------------------

    def fork(self) -> FusedTreeProposer:
        """The same head for another sequence: its own row of the head cache and its own request vocabulary."""
        new = copy.copy(self)
        new.vocab = self.vocab.fork() if hasattr(self.vocab, "fork") else self.vocab
        new._row, new._pending = -1, None
        return new

    def start(self, ctx: ProposalContext, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        self.head_rows.acquire(self, capacity=ctx.tokens.shape[0] + ctx.max_depth + 64)
        self._pending = None
        self.vocab.reset(ctx.tokens)
        if target_hidden is not None:
            feats = self.head.select_features(target_hidden)[0]  # [T-1, D] features of prompt[:-1]
            self._pending = (feats, ctx.tokens[1:].to(self.device))

    @torch.inference_mode()  # the head cache's buffers are inference tensors
    def finish(self) -> None:
        """The sequence ended: free its row."""
        self.head_rows.release(self)

    def on_verified(self, result: VerifyResult, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        assert target_hidden is not None
        feats = self.head.select_features(target_hidden)[0, result.path.to(target_hidden[-1].device)]  # [A+1, D]
        self.vocab.add(result.tokens)
        toks = result.tokens.to(self.device)
        if self._pending is not None:  # pairs not fed yet (the prefill's, or those of steps that drafted nothing)
            feats, toks = torch.cat([self._pending[0], feats]), torch.cat([self._pending[1], toks])
        self._pending = (feats, toks)

    # -- drafting -------------------------------------------------------------------------------

    @property
    def row(self) -> int:
        """This sequence's row of the shared head cache (`head_rows`), from `start` to `finish`; -1 outside."""
        return self._row

    def propose(self, ctx: ProposalContext) -> DraftTree:
        return type(self).propose_many([self], [ctx])[0]

    @classmethod
    @torch.inference_mode()
    def propose_many(cls, rows: Sequence[FusedTreeProposer], ctxs: Sequence[ProposalContext]) -> list[DraftTree]:
        """Every row's tree, rows that share a head cache drafting in lockstep (`draft_group`: for the dynamic tree
        one head forward per level over all of them, one scoring GEMM over their outputs). Each row's tree is the one
        it drafts alone."""
        trees: list[DraftTree | None] = [None] * len(rows)
        drafting: list[int] = []
        for i, (p, ctx) in enumerate(zip(rows, ctxs)):
            assert p._row >= 0, "start() must be called before propose()"
            if p._pending is None or min(p.config.depth, ctx.max_depth) < 1:
                trees[i] = DraftTree.root_only(int(ctx.tokens[-1]))
            else:
                drafting.append(i)
        groups: dict[int, list[int]] = {}
        for i in drafting:  # rows of one head cache draft together (forks of one proposer share it)
            groups.setdefault(id(rows[i].head_rows), []).append(i)
        for group in groups.values():
            drafted = cls.draft_group([rows[i] for i in group], [ctxs[i] for i in group])
            for i, tree in zip(group, drafted):
                trees[i] = tree
        return trees

    @staticmethod
    def draft_group(rows: list[FusedTreeProposer], ctxs: list[ProposalContext]) -> list[DraftTree]:
        """The trees of rows sharing one head cache, each with pending pairs and a depth >= 1: the EAGLE-2 dynamic
        tree (module doc). A proposer drafting otherwise from the same cache overrides this."""
        return draft_dynamic_trees(rows, ctxs)


# Rows whose pending pairs exceed this catch up in a forward of their own: a newcomer's whole prompt would pad every
# other row's few pairs to its length.
_LONG_CATCH_UP = 32


def draft_dynamic_trees(rows: list[FusedTreeProposer], ctxs: list[ProposalContext]) -> list[DraftTree]:
    """EAGLE-2 drafting for rows sharing one head and head cache (see the module doc), in lockstep."""
    first = rows[0]
    cache, dev = first.head_rows.cache, first.device
    # 1. Catch up: feed each row's pending (feature, token) pairs; the last output predicts the root's feature.
    root_hidden = [h[0] for h in catch_up(rows)]
    committed = torch.tensor([cache.lengths[p._row] for p in rows], device=dev)  # the root's children's position
    depth = torch.tensor([min(p.config.depth, c.max_depth) for p, c in zip(rows, ctxs)])
    roots = [int(c.tokens[-1]) for c in ctxs]
    trees = _expand(rows, torch.stack(root_hidden), roots, committed, depth)
    for p, c in zip(rows, committed.tolist()):
        cache.lengths[p._row] = c  # drafted entries never survive
    return trees


def catch_up(rows: list[FusedTreeProposer], masks: int = 0,
             mask_entry: tuple[torch.Tensor, int] | None = None) -> list[torch.Tensor]:
    """Step 1 for rows sharing one head cache: feed every row's pending pairs (`_feed`, with its `masks` mask entries
    `mask_entry` after them) and clear them; each row's outputs from its last pair on. Rows with few pairs share
    one forward; a long catch-up (a newcomer's prompt) runs in its own."""
    first = rows[0]
    pending = [p._pending for p in rows]
    for p in rows:
        p._pending = None
    short = [b for b, (_, t) in enumerate(pending) if t.shape[0] <= _LONG_CATCH_UP]
    hidden: list[torch.Tensor | None] = [None] * len(rows)
    for batch in [short] + [[b] for b in range(len(rows)) if b not in short]:
        if batch:
            out = _feed(first.head, first.head_rows.cache, [rows[b]._row for b in batch], [pending[b] for b in batch],
                        first.dtype, masks, mask_entry)
            for b, h in zip(batch, out):
                hidden[b] = h
    return hidden


def _window(cache: BatchKVCache, row_ids: list[int]) -> tuple[int, int, torch.Tensor]:
    """The contiguous rows a forward over `row_ids` covers: (first, count, index of each of `row_ids` in it)."""
    lo, hi = min(row_ids), max(row_ids)
    cache.window(lo, hi - lo + 1)
    return lo, hi - lo + 1, torch.tensor(row_ids) - lo


def _visible_own_slots(cache: BatchKVCache, lo: int, count: int, width: int) -> torch.Tensor:
    """[count, width, max(lengths) + width] bool: each query sees only its own new slot (padding rows and queries,
    whose outputs nobody reads, keep a finite softmax)."""
    lengths = torch.tensor(cache.lengths[lo : lo + count])
    end = int(lengths.max()) + width
    visible = torch.zeros(count, width, end, dtype=torch.bool)
    q = torch.arange(width)
    visible[torch.arange(count)[:, None], q, lengths[:, None] + q] = True
    return visible


def _feed(head: nn.Module, cache: BatchKVCache, row_ids: list[int], pairs: list[tuple[torch.Tensor, torch.Tensor]],
          dtype: torch.dtype, masks: int = 0, mask_entry: tuple[torch.Tensor, int] | None = None) -> list[torch.Tensor]:
    """Feed each row's pending pairs (features [m, D], tokens [m]) causally after its committed pairs and commit
    them; returns each row's last output [1, H]. With `masks` > 0, `masks` entries `mask_entry` (feature [D], token)
    follow each row's pairs in the same causal forward, uncommitted, and each row's outputs from its last pair on
    come back: [1 + masks, H] (a block drafter's distributions)."""
    lo, count, at = _window(cache, row_ids)
    width = max(t.shape[0] for _, t in pairs) + masks
    dev = pairs[0][1].device
    tokens = torch.zeros(count, width, dtype=torch.long, device=dev)
    feats = torch.zeros(count, width, pairs[0][0].shape[-1], dtype=dtype, device=dev)
    lengths = torch.tensor(cache.lengths[lo : lo + count])
    positions = (lengths[:, None] + torch.arange(width)).to(dev)  # padding's positions are never read
    visible = _visible_own_slots(cache, lo, count, width)
    for w, (f, t) in zip(at.tolist(), pairs):
        m, length = t.shape[0] + masks, int(lengths[w])
        tokens[w, : t.shape[0]], feats[w, : t.shape[0]] = t, f.to(dtype)
        if masks:
            tokens[w, t.shape[0] : m], feats[w, t.shape[0] : m] = mask_entry[1], mask_entry[0].to(dtype)
        visible[w, :m, :length] = True
        visible[w, :m, length : length + m] = torch.ones(m, m, dtype=torch.bool).tril()
    out = head(tokens, feats, positions, additive_mask(visible, dtype, dev), cache)  # [count, width, H]
    last = []
    for w, (_, t) in zip(at.tolist(), pairs):
        cache.commit(lo + w, torch.arange(t.shape[0]))  # the masks' entries are left past the length: never seen
        last.append(out[w, t.shape[0] - 1 : t.shape[0] + masks])
    return last


def score_rows(rows: list[FusedTreeProposer], hidden: torch.Tensor) -> torch.Tensor:  # [B, n, H] -> [B, n, C] log-probs
    """Each row's draft log-probabilities over its scorer's columns, rows scored together where the scorer can
    (columns past a row's own are -inf)."""
    vocabs = [p.vocab for p in rows]
    kind = type(vocabs[0])
    if len(rows) > 1 and hasattr(kind, "logits_rows") and all(type(v) is kind for v in vocabs):
        logits = kind.logits_rows(vocabs, hidden)
    else:
        per_row = [v.logits(h) for v, h in zip(vocabs, hidden)]
        width = max(x.shape[-1] for x in per_row)
        logits = torch.stack([torch.nn.functional.pad(x, (0, width - x.shape[-1]), value=-math.inf) for x in per_row])
    return logits.log_softmax(-1)


def _expand(rows: list[FusedTreeProposer], root_hidden: torch.Tensor, roots: list[int], committed: torch.Tensor,
            depth: torch.Tensor) -> list[DraftTree]:
    """Steps 2-3 on tensors, for B rows at once: one head forward per level, no Python loop over nodes.

    Candidates are numbered in creation order: level 1 holds the root's `topk` children, every later level `topk`
    children of each of its `topk` expanded parents. Scores (cumulative draft log-probability) add up in float64, so
    rankings are those of exact sums. Ties go to the earlier candidate everywhere. A row stops expanding at its depth
    or when its best open node falls below the budget's floor; it rides along (its outputs unread) while others go on.
    """
    first = rows[0]
    cfg, k, dev = first.config, first.config.topk, first.device
    cache = first.head_rows.cache
    b_rows = len(rows)
    row_ids = [p._row for p in rows]
    lo, count, at = _window(cache, row_ids)
    logp = score_rows(rows, root_hidden[:, None])[:, 0]  # [B, C]: children of each root
    top = logp.topk(k, dim=-1)
    tokens = [torch.stack([p.vocab.token_ids(i) for p, i in zip(rows, top.indices)])]  # per level: [B, n_d]
    scores = [top.values.double()]  # per level: [B, n_d] cumulative log-probabilities
    parents = [torch.zeros(b_rows, k, dtype=torch.long, device=dev)]  # per level: [B, n_d] parent candidate (0: root)
    # Per level: which fed row predicts each candidate's children (-1: the root, whose pair is committed) and the
    # head output holding that prediction's input feature.
    parent_row = torch.full((b_rows, k), -1, dtype=torch.long, device=dev)  # [B, n_d]
    parent_hidden = root_hidden[:, None].expand(-1, k, -1)  # [B, n_d, H]
    first_id = 1  # candidate number of the level's first node
    seen = torch.zeros(b_rows, 0, 0, dtype=torch.bool, device=dev)  # [B, F, F]: fed i sees fed j (ancestor or itself)
    levels = torch.ones(b_rows, dtype=torch.long)  # levels each row keeps
    active = torch.ones(b_rows, dtype=torch.bool)
    below = first.stop_below() if first.stop_below is not None else 0.0
    floor = math.log(below) if below > 0 else None
    batch = torch.arange(b_rows, device=dev)
    committed_at = committed.tolist()  # host copies, read every level
    for d in range(2, int(depth.max()) + 1):
        level_scores = scores[-1]  # [B, n]
        active &= depth >= d
        if floor is not None:  # one host sync per level, only with a floor
            active &= (level_scores.max(dim=1).values >= floor).cpu()
        if not bool(active.any()):
            break
        levels += active.long()
        expand = torch.sort(level_scores, dim=1, descending=True, stable=True).indices[:, :k]  # [B, E]
        e, fed = expand.shape[1], seen.shape[1]
        visible_rows = torch.zeros(b_rows, e, fed + e, dtype=torch.bool, device=dev)  # what each expanded node sees
        prow = parent_row.gather(1, expand)  # [B, E]
        has_parent = prow >= 0
        if fed:
            inherited = seen[batch[:, None], prow.clamp(min=0)]  # [B, E, F]
            visible_rows[:, :, :fed] = inherited & has_parent[:, :, None]
        visible_rows[:, :, fed:] = torch.eye(e, dtype=torch.bool, device=dev)
        seen = torch.cat([torch.nn.functional.pad(seen, (0, e)), visible_rows], dim=1)
        visible = _visible_own_slots(cache, lo, count, e)
        tree_part = visible_rows.cpu()  # one transfer per level
        for b, (w, c) in enumerate(zip(at.tolist(), committed_at)):  # the row's committed pairs and fed tree nodes
            visible[w, :, :c] = True
            visible[w, :, c : c + fed + e] = tree_part[b]
        pos = torch.zeros(count, e, dtype=torch.long, device=dev)
        pos[at] = (committed + d - 2)[:, None].expand(-1, e)
        tok_in = torch.zeros(count, e, dtype=torch.long, device=dev)
        tok_in[at] = tokens[-1].gather(1, expand)
        feat_in = parent_hidden.new_zeros(count, e, parent_hidden.shape[-1])
        feat_in[at] = parent_hidden.gather(1, expand[:, :, None].expand(-1, -1, parent_hidden.shape[-1]))
        # Feed (predicted feature of the node's parent, node token) for each expanded node.
        h = first.head(tok_in, feat_in, pos, additive_mask(visible, parent_hidden.dtype, dev), cache)[at]  # [B, E, H]
        for r in row_ids:
            cache.commit(r, torch.arange(e))  # the level's entries, seen by the next levels; rolled back at the end
        top = score_rows(rows, h).topk(k, dim=-1)  # [B, E, k]
        tokens.append(torch.stack([p.vocab.token_ids(i) for p, i in zip(rows, top.indices)]).flatten(1))
        scores.append((level_scores.gather(1, expand)[:, :, None] + top.values.double()).flatten(1))
        parents.append((first_id + expand).repeat_interleave(k, dim=1))
        parent_row = (fed + torch.arange(e, device=dev)).repeat_interleave(k)[None].expand(b_rows, -1)
        parent_hidden = h.repeat_interleave(k, dim=1)
        first_id += level_scores.shape[1]
    return [_rerank(cfg, roots[b], [t[b] for t in tokens[: levels[b]]], [s[b] for s in scores[: levels[b]]],
                    [q[b] for q in parents[: levels[b]]]) for b in range(b_rows)]


def _rerank(cfg: TreeConfig, root: int, tokens: list[torch.Tensor], scores: list[torch.Tensor],
            parents: list[torch.Tensor]) -> DraftTree:
    """Step 3 for one row: the best total_tokens-1 candidates by score. Candidates are numbered level by level, so
    the stable sort sends ties to the shallower node; as a child never scores above its parent (log-probabilities
    are <= 0), the set is ancestor-closed."""
    dev = scores[0].device
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


class HeadVocabulary:
    """Scores a head's outputs with its own LM head over its draft vocabulary (its `draft_logits`, `token_ids`),
    for heads that carry one: no tokens of the request can be added to what it scores."""

    def __init__(self, head: nn.Module) -> None:
        self.head = head

    def reset(self, tokens: torch.Tensor) -> None:
        pass

    def add(self, tokens: torch.Tensor) -> None:
        pass

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, Vd], fp32
        return self.head.draft_logits(hidden).float()

    @staticmethod
    def logits_rows(vocabs: Sequence[HeadVocabulary], hidden: torch.Tensor) -> torch.Tensor:  # [B, n, H] -> [B, n, Vd]
        if any(v.head is not vocabs[0].head for v in vocabs):
            raise ValueError("rows scored together must share the head")
        return vocabs[0].head.draft_logits(hidden).float()

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:
        return self.head.token_ids(index)


def tree_proposer(target, options: TreeOptions, kind: str,
                  scorer: Callable[[nn.Module], DraftScorer | None] = lambda head: None,
                  proposer: Callable[..., FusedTreeProposer] | None = None) -> Proposer:
    """The `kind` heads in `options.heads` drafting the tree `options` name (built by `proposer`, default
    `FusedTreeProposer`), prompt lookup grafted on. A head that drafts a block of `config.num_depths` tokens drafts
    that deep by default, and no deeper."""
    head = load_heads(options.heads, target, kind=kind)
    depth = options.depth or named_tree(options.tree).depth
    block = getattr(head.config, "num_depths", None)
    if block is not None:
        if options.depth is not None and options.depth > block:
            raise ValueError(f"--depth {options.depth}: these {kind} heads draft blocks of {block} tokens; use "
                             f"--depth {block} or less")
        depth = options.depth or block
    int8 = options.draft_dtype == "int8"
    if int8:
        quantize_linears(head)
    budget = node_budget(target, options.node_budget)
    drafter = (proposer or FusedTreeProposer)(head, tree_config(options, depth), vocab=scorer(head),
                                              int8_vocab=int8,
                                              stop_below=budget.stop_below if budget is not None else None)
    return with_heads_options(drafter, target, options, budget)


