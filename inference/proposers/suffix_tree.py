"""A suffix tree cut at a fixed depth, with occurrence counts: what suffix decoding matches contexts against.

Every window of up to `depth` consecutive tokens of every sequence held is a path from the root; a node's `count` is
how many windows pass through it, i.e. how often its string occurs. So the children of the node a context's suffix
leads to are the tokens that followed that suffix, and child count / sum of the children's counts is how often each
did: SuffixDecoding's (Oliaro et al., 2024) estimate that the continuation is followed again.

Why this structure, and not a suffix automaton (which matches arbitrarily long suffixes in O(n) states):

1. Appending a token extends the windows that end at it, one node each: O(depth) per token, online, so a request's
   own tree grows as its tokens are committed.
2. Removing a whole sequence walks its windows again and decrements them (a node whose count reaches 0 goes, with
   its subtree). The global cache evicts finished requests one by one; an automaton cannot forget a text, so every
   eviction would rebuild it.
3. Counts are plain occurrence counts at every node, where an automaton needs them propagated along suffix links.

The price is memory: up to `depth` nodes per token held (CPython: about 80 bytes each), shared wherever texts repeat.
Path compression (arctic-inference's C++ tree) makes it one node per token at the cost of splitting edges on
insertion and re-pointing them on removal; the cache's token bound keeps this one small instead (docs/decoding.md).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


class _Node:
    """One string: `count` windows pass through it; `kids` holds the next tokens: None (none yet), one node (most
    nodes deep in the tree, where text no longer repeats) or {token: node}."""

    __slots__ = ("count", "depth", "kids", "seq", "token")

    def __init__(self, token: int, depth: int, seq: int) -> None:
        self.token, self.depth, self.seq = token, depth, seq  # seq: the latest sequence through it (what a match uses)
        self.count = 0
        self.kids: _Node | dict[int, _Node] | None = None

    def child(self, token: int) -> _Node | None:
        kids = self.kids
        if kids is None:
            return None
        if type(kids) is _Node:
            return kids if kids.token == token else None
        return kids.get(token)

    def children(self) -> list[_Node]:
        kids = self.kids
        if kids is None:
            return []
        return [kids] if type(kids) is _Node else list(kids.values())

    def add(self, token: int, seq: int) -> _Node:
        node = _Node(token, self.depth + 1, seq)
        kids = self.kids
        if kids is None:
            self.kids = node
        elif type(kids) is _Node:
            self.kids = {kids.token: kids, token: node}
        else:
            kids[token] = node
        return node

    def drop(self, token: int) -> None:
        kids = self.kids
        if type(kids) is _Node:
            self.kids = None
        else:
            del kids[token]
            if len(kids) == 1:
                self.kids = next(iter(kids.values()))


@dataclass
class Draft:
    """Continuations of a matched suffix as a tree: node i is `tokens[i]`, child of node `parents[i]` (-1: of the
    root), with `probs[i]` the estimated probability that it and its ancestors are followed."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match: int = 0  # the matched suffix's length
    seq: int = -1  # the sequence whose text the match came from last

    @property
    def score(self) -> float:
        """Tokens expected to be accepted."""
        return sum(self.probs)

    def paths(self) -> tuple[list[list[int]], list[list[float]]]:
        """Root-to-leaf token paths and their nodes' probabilities, most probable leaf first (for `DraftTree.graft`)."""
        leaves = set(range(len(self.tokens))) - set(self.parents)
        paths, probs = [], []
        for leaf in sorted(leaves, key=lambda i: (-self.probs[i], i)):
            path, node = [], leaf
            while node != -1:
                path.append(node)
                node = self.parents[node]
            paths.append([self.tokens[i] for i in reversed(path)])
            probs.append([self.probs[i] for i in reversed(path)])
        return paths, probs


@dataclass(frozen=True)
class DraftLimits:
    """How much a match may draft: SuffixDecoding's adaptive size, `factor` x match length nodes, at most `max_nodes`
    and `max_depth` levels deep, each node's probability at least `min_prob`."""

    max_nodes: int
    max_depth: int
    factor: float
    min_prob: float
    max_match: int  # the longest suffix of the context tried


class SuffixTree:
    """The windows of up to `depth` tokens of several sequences (each appended to incrementally), with counts."""

    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"a suffix tree needs depth >= 2 (a token to match, one to draft), got {depth}")
        self.depth = depth
        self.root = _Node(-1, 0, -1)
        self.nodes = 1
        self._texts: dict[int, list[int]] = {}
        self._open: dict[int, list[_Node]] = {}  # per sequence still growing: the nodes of its windows that may grow

    def __contains__(self, seq: int) -> bool:
        return seq in self._texts

    def tokens(self, seq: int) -> list[int]:
        return self._texts[seq]

    def extend(self, seq: int, tokens: Iterable[int]) -> None:
        """Append `tokens` to sequence `seq` (a new one if unknown): every window ending at a new token is counted."""
        text = self._texts.setdefault(seq, [])
        growing = self._open.setdefault(seq, [])
        root, depth = self.root, self.depth
        for tok in tokens:
            tok = int(tok)
            text.append(tok)
            grown = []
            for node in (root, *growing):
                nxt = node.child(tok)
                if nxt is None:
                    nxt = node.add(tok, seq)
                    self.nodes += 1
                nxt.count += 1
                nxt.seq = seq
                if nxt.depth < depth:
                    grown.append(nxt)
            growing[:] = grown

    def close(self, seq: int) -> None:
        """`seq` will not grow any more: forget its growing windows (its text stays, for `remove`)."""
        self._open.pop(seq, None)

    def remove(self, seq: int) -> None:
        """Forget sequence `seq`: each of its windows is uncounted, and nodes no window passes through go."""
        text = self._texts.pop(seq)
        self._open.pop(seq, None)
        for start in range(len(text)):
            node = self.root
            for tok in text[start : start + self.depth]:
                nxt = node.child(tok)
                assert nxt is not None and nxt.count > 0, "a removed window was never counted"
                nxt.count -= 1
                if nxt.count == 0:  # only this window went this way: its whole subtree is this window's tail
                    node.drop(tok)
                    self.nodes -= self._size(nxt)
                    break
                node = nxt

    @staticmethod
    def _size(node: _Node) -> int:
        size, stack = 0, [node]
        while stack:
            n = stack.pop()
            size += 1
            stack.extend(n.children())
        return size

    def draft(self, context: Sequence[int], limits: DraftLimits) -> Draft:
        """The best-scoring draft over the suffixes of `context` that occur here, 1 to `limits.max_match` tokens long
        (ties: the longer match).

        1. Match each suffix from the root; stop at the first that does not occur (no longer one does).
        2. From the matched node, expand best-first (`_expand`), at most `factor` x match length nodes.
        3. Score each draft by its nodes' summed probabilities (tokens expected to be accepted)."""
        best = Draft()
        longest = min(limits.max_match, len(context), self.depth - 1)
        for m in range(1, longest + 1):
            node = self.root
            for tok in context[len(context) - m:]:
                node = node.child(int(tok))
                if node is None:
                    return best
            size = min(limits.max_nodes, int(limits.factor * m + 1e-6))
            if size < 1:
                continue
            draft = self._expand(node, size, limits)
            draft.match = m
            if draft.tokens and draft.score >= best.score:
                best = draft
        return best

    def _expand(self, matched: _Node, size: int, limits: DraftLimits) -> Draft:
        """Up to `size` nodes below `matched`, most probable first: a child's probability is its parent's times its
        share of the parent's continuations; nodes below `min_prob` and deeper than `max_depth` are not drafted."""
        draft = Draft(seq=matched.seq)
        heap: list[tuple[float, int, _Node, int]] = []  # (-probability, order pushed, node, parent's draft index)
        order = 0

        def push(node: _Node, prob: float, parent: int) -> None:
            nonlocal order
            kids = node.children()
            total = sum(k.count for k in kids)
            for kid in sorted(kids, key=lambda k: -k.count):  # stable: equal counts keep insertion order
                p = prob * kid.count / total
                if p >= limits.min_prob:
                    heapq.heappush(heap, (-p, order, kid, parent))
                    order += 1

        push(matched, 1.0, -1)
        while heap and len(draft.tokens) < size:
            neg, _, node, parent = heapq.heappop(heap)
            draft.tokens.append(node.token)
            draft.parents.append(parent)
            draft.probs.append(-neg)
            if node.depth - matched.depth < limits.max_depth:
                push(node, -neg, len(draft.tokens) - 1)
        return draft
