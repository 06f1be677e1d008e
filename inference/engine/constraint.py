"""A grammar over one sequence's output, applied to every node of its draft trees: decoding stays exact with respect to
the *constrained* target, whose next-token law at any node is the target's, masked by the grammar state after that
node's own path (and renormalised).

Per step, before verification (`shape`):
1. Walk the tree depth first, the grammar matcher following each node's path (consume going down, roll back coming
   up), and record at each node the tokens its grammar state allows next.
2. Prune drafts the grammar forbids: a forbidden token has probability 0 under the constrained target, so verifying it
   could only reject it. Pruning is what verification would do only when the drafts are deterministic (the tree has
   no draft distributions, so a rejection just removes the token): sampled drafts stay, and verification rejects
   them, because removing a sampled child would change the residual law the next children are tested against.
3. Draft for free what the grammar forces: from each leaf, the tokens the grammar forces next (llguidance's
   fast-forward tokens, e.g. the rest of a JSON key the schema fixes) join the tree as a chain, deterministic drafts
   (one-hot rows in a sampled tree), up to the step's depth.
At verification (`mask_logits`), each node's logits outside its allowed set become -inf; the verifier, greedy or
stochastic, then runs unchanged on the constrained law. After it, `commit` advances the matcher over the committed
tokens.

The sequence's stop tokens are allowed exactly where the grammar accepts (so a schema's document is always finished
before the answer ends); without stop tokens the tokenizer's end-of-sequence tokens play that part.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from specheads.inference.engine.grammar import Grammar, _llguidance, lltokenizer
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult

MAX_FORCED = 32  # forced tokens drafted per leaf and step: a long fixed key costs one verify, not a step per token


class GrammarConstraint:
    """One sequence's grammar state (an llguidance matcher at its committed tokens)."""

    def __init__(self, grammar: Grammar, tokenizer: Any, *, vocab_size: int,
                 stop_token_ids: Iterable[int] = ()) -> None:
        llg = _llguidance()
        import llguidance.torch as llg_torch

        self._fill = llg_torch.fill_next_token_bitmask
        self._tok = lltokenizer(tokenizer)
        self.grammar = grammar
        self._matcher = llg.LLMatcher(self._tok, grammar.source, log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"the {grammar.kind} constraint does not compile: {self._matcher.get_error()}; "
                             f"fix the {grammar.kind}")
        self.vocab_size = vocab_size
        self._words = torch.zeros(1, (self._tok.vocab_size + 31) // 32, dtype=torch.int32)
        self._shift = torch.arange(32, dtype=torch.int32)
        grammar_ends = [t for t in self._tok.eos_tokens if t < vocab_size]
        stops = sorted({int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size})
        self.end_tokens: tuple[int, ...] = tuple(stops or grammar_ends)  # where the answer may end
        self._not_grammar = torch.tensor(sorted(set(grammar_ends) | set(self.end_tokens)), dtype=torch.long)
        self._ends = torch.tensor(self.end_tokens, dtype=torch.long)
        self._end_set = set(self.end_tokens)
        self._shaped: DraftTree | None = None
        self._masks: list[torch.Tensor | None] = []  # per node of `_shaped`: allowed next tokens [V] bool, or None
        # Per node of `_shaped`, its index in the proposer's view (None: the proposer's own tree, unchanged).
        self._view: torch.Tensor | None = None  # [N] long

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows after the matcher's current tokens."""
        self._fill(self._matcher, self._words, 0)
        bits = ((self._words[0, :, None] >> self._shift) & 1).flatten().bool()  # [32 * words]
        out = torch.zeros(self.vocab_size, dtype=torch.bool)
        n = min(self.vocab_size, self._tok.vocab_size)
        out[:n] = bits[:n]
        out[self._not_grammar] = False
        if self._matcher.is_accepting():
            out[self._ends] = True
        return out

    def shape(self, tree: DraftTree, max_depth: int) -> DraftTree:
        """`tree` with the drafts the grammar forbids pruned (deterministic drafts only) and the tokens it forces
        drafted from its leaves, no deeper than `max_depth`; the per-node masks are kept for `mask_logits`."""
        deterministic = tree.draft_probs is None
        tokens: list[int] = [int(tree.tokens[0])]
        parents: list[int] = [-1]
        origin: list[int] = [0]  # new node -> tree's node (-1: a forced token drafted here)
        masks: list[torch.Tensor | None] = [None]
        matcher = self._matcher
        kids = tree.children
        all_tokens = tree.tokens.tolist()

        def add(token: int, parent: int, source: int) -> int:
            tokens.append(token)
            parents.append(parent)
            origin.append(source)
            masks.append(None)
            return len(tokens) - 1

        def keep_subtree(old: int, new: int) -> None:  # a sampled draft the grammar forbids: verification rejects it
            for c in kids[old]:
                keep_subtree(c, add(all_tokens[c], new, c))

        def visit(old: int, new: int, depth: int) -> None:
            allowed = masks[new] = self.allowed()
            children = kids[old] if old >= 0 else ()
            for c in children:
                t = all_tokens[c]
                if not bool(allowed[t]):
                    if not deterministic:
                        keep_subtree(c, add(t, new, c))
                    continue
                child = add(t, new, c)
                if t in self._end_set:
                    continue  # the answer ends there: nothing below it can be committed
                ok = matcher.consume_token(t)
                assert ok, matcher.get_error()
                visit(c, child, depth + 1)
                matcher.rollback(1)
            if len(tokens) - 1 == new and depth < max_depth:  # a leaf: draft what the grammar forces
                parent, consumed = new, 0
                for t in matcher.compute_ff_tokens()[: min(max_depth - depth, MAX_FORCED)]:
                    if not bool(allowed[t]) or t in self._end_set:
                        break
                    parent = add(t, parent, -1)
                    ok = matcher.consume_token(t)
                    assert ok, matcher.get_error()
                    consumed += 1
                    allowed = masks[parent] = self.allowed()
                matcher.rollback(consumed)

        visit(0, 0, 0)
        if self._matcher.is_error():
            raise RuntimeError(f"the grammar matcher failed while walking a draft tree: {self._matcher.get_error()}")
        if origin == list(range(tree.size)):
            shaped, view = tree, None  # nothing pruned or forced: keep the proposer's tree (and its derived fields)
        else:
            shaped = self._rebuild(tree, tokens, parents, origin)
            forced = torch.tensor([o < 0 for o in origin])
            view = torch.tensor(origin, dtype=torch.long)
            view[forced] = tree.size + torch.arange(int(forced.sum()))
        self._shaped, self._masks, self._view = shaped, masks, view
        return shaped

    def proposer_view(self, result: VerifyResult, hidden: tuple[torch.Tensor, ...] | None
                      ) -> tuple[VerifyResult, tuple[torch.Tensor, ...] | None]:
        """`result` and the target's hidden states over the shaped tree's nodes ([1, N, H] each), as the proposer
        that drafted the unshaped tree reads them: its own nodes keep their indices (pruned ones, never on the path,
        get the root's states), forced tokens follow them as nodes tree.size, tree.size + 1, ... in path order."""
        if self._view is None:
            return result, hidden
        view = self._view.to(result.path.device)
        path = view[result.path]
        if hidden is not None:
            size = int(view.max()) + 1
            rows = torch.zeros(size, dtype=torch.long, device=hidden[0].device)
            rows[view.to(rows.device)] = torch.arange(view.shape[0], device=rows.device)
            hidden = tuple(h[:, rows] for h in hidden)
        return VerifyResult(path=path, tokens=result.tokens), hidden

    @staticmethod
    def _rebuild(tree: DraftTree, tokens: list[int], parents: list[int], origin: list[int]) -> DraftTree:
        device = tree.tokens.device
        src = torch.tensor([max(o, 0) for o in origin], dtype=torch.long)
        forced = torch.tensor([o < 0 for o in origin])
        draft_probs = accept_probs = None
        if tree.draft_probs is not None:
            draft_probs = tree.draft_probs[src.to(tree.draft_probs.device)].clone()
            for i in forced.nonzero().flatten().tolist():  # a forced child is a deterministic draft: one-hot row
                draft_probs[parents[i]] = 0.0
                draft_probs[parents[i], tokens[i]] = 1.0
        if tree.accept_probs is not None:
            accept_probs = tree.accept_probs[src].clone()
            for i in forced.nonzero().flatten().tolist():
                accept_probs[i] = accept_probs[parents[i]]  # parents come first, so this chains down
        # Extra rows (lookahead's window) see only the root and each other, so they survive the reshaping as they are.
        return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long, device=device),
                         parents=torch.tensor(parents, dtype=torch.long, device=device),
                         draft_probs=draft_probs, accept_probs=accept_probs, extra=tree.extra)

    def mask_logits(self, tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [N, V] with each node's tokens outside its grammar state set to -inf, in place (the engine's
        slice of the forward's output, read by nothing else) and returned."""
        if tree is not self._shaped:
            self.shape(tree, max_depth=0)  # a tree the engine did not shape (cannot grow: depth 0)
            if self._shaped is not tree:
                raise RuntimeError("the draft tree changed after the grammar shaped it; shape it once, then verify it")
        rows = [i for i, m in enumerate(self._masks) if m is not None]
        allowed = torch.ones(logits.shape, dtype=torch.bool)  # rows without a mask (forbidden sampled drafts): as is
        allowed[rows, : self.vocab_size] = torch.stack([self._masks[i] for i in rows])[:, : logits.shape[-1]]
        allowed[rows, self.vocab_size :] = False
        if not bool(allowed.any(dim=-1).all()):
            raise ValueError(f"the {self.grammar.kind} constraint allows no token here (a grammar that cannot "
                             "finish, or an end token the tokenizer lacks); check the constraint")
        return logits.masked_fill_(~allowed.to(logits.device), float("-inf"))

    def commit(self, tokens: Iterable[int]) -> None:
        """Advance the grammar over tokens the verifier committed (an end token finishes the answer: not consumed)."""
        self._shaped = None
        for t in tokens:
            if int(t) in self._end_set:
                return
            if not self._matcher.consume_token(int(t)):
                raise RuntimeError(f"committed token {int(t)} breaks the grammar: {self._matcher.get_error()}")
