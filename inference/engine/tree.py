"""The draft tree: what every proposer returns and what the target verifies.

Node 0 is the root: the last committed token, which is not yet in the target's
KV cache. Nodes are in topological order (a parent comes before its children),
and siblings are distinct tokens. A chain is a tree with one child per node.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

import torch

from specheads.inference.engine.extra_rows import ExtraRows


@dataclass(frozen=True)
class DraftTree:
    tokens: torch.Tensor  # [N] long; tokens[0] is the root
    parents: torch.Tensor  # [N] long; parents[0] == -1, parents[i] < i
    # Row i is the distribution node i's children were drawn from, without replacement, in child order.
    # None means the children were chosen deterministically (argmax, top-k, lookup): the verifier then
    # treats each child's draft distribution as one-hot, which keeps acceptance exact.
    draft_probs: torch.Tensor | None = None  # [N, V] fp32
    # The proposer's estimate that node i is accepted (it and all its ancestors), root 1; None: no estimate.
    # Only `NodeBudget` reads it, to choose how many nodes are worth verifying; it never affects acceptance.
    accept_probs: torch.Tensor | None = None  # [N] fp64 on CPU
    # Rows the verify forward carries after the nodes, never candidates for acceptance (lookahead decoding's Jacobi
    # window, `extra_rows.py`): the verifier ignores them and the engine hands their logits to the proposer.
    extra: ExtraRows | None = None
    depths: torch.Tensor = field(init=False)  # [N] long; root has depth 0
    ancestors: torch.Tensor = field(init=False)  # [N, N] bool; ancestors[i, j]: j is i or an ancestor of i

    def __post_init__(self) -> None:
        n = self.parents.shape[0]
        assert self.tokens.shape == (n,), (self.tokens.shape, n)
        parents = self.parents.cpu()
        assert n >= 1 and int(parents[0]) == -1, "node 0 is the root"
        assert bool((parents[1:] >= 0).all()) and bool((parents[1:] < torch.arange(1, n)).all()), \
            "parents must come before their children"
        # Walk every node up one level at a time (as many rounds as the tree is deep), on tensors.
        anc = torch.eye(n, dtype=torch.bool)
        depths = torch.zeros(n, dtype=torch.long)
        rows = torch.arange(n)
        up = parents.clone()
        while bool((up >= 0).any()):
            live = up >= 0
            anc[rows[live], up[live]] = True
            depths += live
            up = torch.where(live, parents[up.clamp(min=0)], up)
        device = self.tokens.device
        object.__setattr__(self, "depths", depths.to(device))
        object.__setattr__(self, "ancestors", anc.to(device))
        if self.draft_probs is not None:
            assert self.draft_probs.shape[0] == n, (self.draft_probs.shape, n)
        if self.accept_probs is not None:
            assert self.accept_probs.shape == (n,), (self.accept_probs.shape, n)

    @functools.cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:  # per node, its children in draft order
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            kids[p].append(i)
        return tuple(tuple(k) for k in kids)

    @classmethod
    def root_only(cls, token: int | torch.Tensor, device: torch.device | str = "cpu") -> DraftTree:
        """The tree of a plain autoregressive step: just the last committed token."""
        tok = torch.as_tensor([int(token)], dtype=torch.long, device=device)
        return cls(tokens=tok, parents=torch.tensor([-1], dtype=torch.long, device=device))

    @classmethod
    def chain(cls, tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> DraftTree:
        """A chain root -> tokens[1] -> tokens[2] ...; tokens [N] include the root."""
        n = tokens.shape[0]
        parents = torch.arange(-1, n - 1, dtype=torch.long, device=tokens.device)
        return cls(tokens=tokens, parents=parents, draft_probs=draft_probs)

    def with_tokens(self, tokens: torch.Tensor, accept_probs: torch.Tensor | None = None) -> DraftTree:
        """This tree's shape with new token ids [N] (and acceptance estimates [N]), skipping the per-node set-up
        (for static trees).

        copy.copy does not call __init__, so the derived fields (depths, ancestors, children) are
        shared with this tree; a frozen DraftTree never mutates them.
        """
        assert tokens.shape == self.tokens.shape, (tokens.shape, self.tokens.shape)
        assert accept_probs is None or accept_probs.shape == tokens.shape, (accept_probs.shape, tokens.shape)
        tree = copy.copy(self)
        object.__setattr__(tree, "tokens", tokens)
        object.__setattr__(tree, "accept_probs", accept_probs)
        return tree

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def input_size(self) -> int:  # rows of its verify forward: the nodes, then any extra rows
        return self.size if self.extra is None else self.size + self.extra.size

    @property
    def input_tokens(self) -> torch.Tensor:  # [input_size] long
        return self.tokens if self.extra is None else torch.cat([self.tokens, self.extra.tokens.to(self.tokens.device)])

    @property
    def input_depths(self) -> torch.Tensor:  # [input_size] long; a row's position is the root's plus its depth
        return self.depths if self.extra is None else torch.cat([self.depths, self.extra.depths.to(self.depths.device)])

    @property
    def input_visible(self) -> torch.Tensor:  # [input_size, input_size] bool on CPU: which inputs each input sees
        if self.extra is None:
            return self.ancestors.cpu()
        n = self.size
        out = torch.zeros(self.input_size, self.input_size, dtype=torch.bool)
        out[:n, :n] = self.ancestors.cpu()  # a node never sees an extra row
        out[n:] = self.extra.visible(n)
        return out

    @property
    def num_drafted(self) -> int:
        return self.size - 1

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    @property
    def is_chain(self) -> bool:  # one child per node: in topological order, node i's parent is i - 1
        return torch.equal(self.parents.cpu(), torch.arange(-1, self.size - 1))

    @property
    def is_plain_chain(self) -> bool:  # a chain with no extra rows: the model's own causal mask expresses its forward
        return self.extra is None and self.is_chain

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, inclusive."""
        path = []
        parents = self.parents.tolist()
        while node != -1:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def graft(self, paths: list[list[int]], max_new_nodes: int,
              path_probs: list[list[float]] | None = None) -> DraftTree:
        """This tree with token paths from the root merged in, trie-style: a path follows existing
        nodes while their tokens match and adds the rest as new nodes, up to `max_new_nodes` in all.

        `path_probs[j][i]`: the estimated acceptance probability of paths[j][:i + 1]; a node both sides
        propose keeps the larger estimate. The result has `accept_probs` when both sides estimate them.
        Only for deterministic trees (`draft_probs` None): a grafted node has no draft distribution.
        """
        if self.draft_probs is not None:
            raise ValueError("cannot graft onto a tree of sampled drafts (draft_probs set)")
        if not paths or max_new_nodes < 1:  # most steps of a lookup with no match: skip the rebuild
            return self
        tokens = self.tokens.tolist()
        parents = self.parents.tolist()
        child_of = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens)) if i}
        estimated = path_probs is not None and (self.accept_probs is not None or self.size == 1)
        probs = (self.accept_probs.tolist() if self.accept_probs is not None else [1.0]) if estimated else []
        added = 0
        for j, path in enumerate(paths):
            node = 0
            for i, tok in enumerate(path):
                nxt = child_of.get((node, tok))
                if nxt is None:
                    if added >= max_new_nodes:
                        break
                    nxt = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                    child_of[(node, tok)] = nxt
                    added += 1
                    if estimated:
                        probs.append(0.0)
                if estimated:
                    probs[nxt] = max(probs[nxt], path_probs[j][i])
                node = nxt
        if not added and not estimated:
            return self
        device = self.tokens.device
        return DraftTree(tokens=torch.tensor(tokens, dtype=torch.long, device=device),
                         parents=torch.tensor(parents, dtype=torch.long, device=device),
                         accept_probs=torch.tensor(probs, dtype=torch.float64) if estimated else None,
                         extra=self.extra)

    def truncated(self, max_depth: int) -> DraftTree:
        """The subtree of nodes, and the extra rows, at depth <= max_depth (keeps topological order)."""
        if self.extra is not None and int(self.extra.depths.max()) > max_depth:
            tree = copy.copy(self)  # the same nodes and derived fields, fewer extra rows
            object.__setattr__(tree, "extra", self.extra.up_to(max_depth))
            return tree.truncated(max_depth)
        if self.max_depth <= max_depth:
            return self
        return self.subtree((self.depths <= max_depth).nonzero().squeeze(1))

    def within_leaves(self, limit: int) -> DraftTree:
        """The subtree of the first nodes (in draft order) that has at most `limit` leaves; the tree itself if it
        has no more. A node joins if its parent did, and costs a leaf unless its parent had none of its children yet."""
        parents = self.parents.cpu().tolist()
        kept, has_child, leaves = [0], [False] * self.size, 1
        joined = {0}
        for node in range(1, self.size):
            parent = parents[node]
            if parent not in joined:
                continue
            if has_child[parent]:
                if leaves == limit:
                    continue
                leaves += 1
            has_child[parent] = True
            kept.append(node)
            joined.add(node)
        return self if len(kept) == self.size else self.subtree(torch.tensor(kept, dtype=torch.long))

    def subtree(self, keep: torch.Tensor) -> DraftTree:
        """The nodes `keep` [K] (increasing indices, 0 first, ancestor-closed), renumbered in the same order."""
        remap = torch.full((self.size,), -1, dtype=torch.long, device=self.parents.device)
        keep = keep.to(self.parents.device)
        remap[keep] = torch.arange(keep.shape[0], device=self.parents.device)
        old_parents = self.parents[keep]
        new_parents = torch.where(old_parents >= 0, remap[old_parents.clamp(min=0)], old_parents)
        assert bool((new_parents[1:] >= 0).all()), "a subtree keeps every kept node's parent"
        probs = None if self.draft_probs is None else self.draft_probs[keep.to(self.draft_probs.device)]
        accept = None if self.accept_probs is None else self.accept_probs[keep.cpu()]
        return DraftTree(tokens=self.tokens[keep.to(self.tokens.device)], parents=new_parents, draft_probs=probs,
                         accept_probs=accept, extra=self.extra)  # extra rows see only the root, always kept
