"""The pure verifier: draft tree + target logits -> accepted path + bonus token.

No cache, no model: the engine hands in the target's logits at every tree node
(row i is the target's next-token distribution after the path to node i).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.inference.engine.sampling import SamplingParams, sample
from specheads.inference.engine.tree import DraftTree


@dataclass(frozen=True)
class VerifyResult:
    path: torch.Tensor  # [A+1] long; accepted node indices, starting with the root 0
    tokens: torch.Tensor  # [A+1] long; tokens to commit: the A accepted draft tokens, then the bonus token
    # The target's logits at the tree's extra rows (`extra_rows.py`), set by the engine for the proposer; never
    # read or set by verification
    extra_logits: torch.Tensor | None = None  # [E, V]

    @property
    def num_accepted(self) -> int:
        return self.path.shape[0] - 1


def verify(
    tree: DraftTree,
    target_logits: torch.Tensor,  # [N, V]
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Greedy verification at temperature 0, exact recursive rejection sampling otherwise."""
    assert target_logits.shape[0] == tree.size, (target_logits.shape, tree.size)
    if sampling.greedy:
        return verify_greedy(tree, target_logits)
    return verify_stochastic(tree, sampling.probs(target_logits), generator)


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> VerifyResult:
    """Longest root path whose every token equals the target's argmax at its parent, plus the bonus.

    1. argmax[i] is the target's choice after node i.
    2. Node i matches when tokens[i] == argmax[parent[i]] (the root always matches).
    3. A node is accepted when it and all its ancestors match; take the deepest one
       (the first in node order on ties, i.e. the proposer's preferred branch).
    4. The bonus is the argmax at that node.
    """
    argmax = target_logits.argmax(dim=-1).to(tree.tokens.device)  # [N]; one small copy when logits live on a GPU
    match = torch.ones_like(tree.tokens, dtype=torch.bool)
    match[1:] = tree.tokens[1:] == argmax[tree.parents[1:]]
    accepted = ~(tree.ancestors & ~match[None, :]).any(dim=1)  # [N]
    score = torch.where(accepted, tree.depths, -1)
    last = int(score.argmax())
    path = torch.tensor(tree.path_to(last), dtype=torch.long, device=tree.tokens.device)
    tokens = torch.cat([tree.tokens[path[1:]], argmax[last : last + 1]])
    return VerifyResult(path=path, tokens=tokens)


def verify_stochastic(
    tree: DraftTree,
    target_probs: torch.Tensor,  # [N, V] already shaped by SamplingParams.probs
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Multi-draft recursive rejection sampling over the tree (exact).

    From the root, repeatedly:
    1. p = target distribution at the current node; q = the draft distribution its
       children were drawn from (one-hot per child when drafts are deterministic).
    2. For each child x in draft order: accept with probability min(1, p(x) / q(x));
       on acceptance, descend into x and start again.
    3. On rejection: p <- norm(max(p - q, 0)); since children were drawn without
       replacement, also q(x) <- 0 and q <- norm(q). Try the next child.
    4. If no child is accepted (or the node is a leaf), sample the bonus from p.
    """
    node = 0
    path = [0]
    out: list[torch.Tensor] = []
    uniforms = torch.rand(tree.max_depth + 1, max(1, max(len(k) for k in tree.children)), generator=generator,
                          device=target_probs.device)
    while True:
        p = target_probs[node]
        kids = tree.children[node]
        q = None if tree.draft_probs is None else tree.draft_probs[node].clone()
        accepted_child = -1
        depth = len(path) - 1
        for j, child in enumerate(kids):
            x = int(tree.tokens[child])
            px = p[x]
            qx = q[x] if q is not None else torch.ones((), device=p.device)
            if qx > 0 and uniforms[depth, j] * qx < px:  # u < p/q without dividing by zero
                accepted_child = child
                break
            if q is None:
                p = p.clone()
                p[x] = 0.0
            else:
                p = (p - q).clamp(min=0.0)
                q[x] = 0.0
                q = q / q.sum().clamp(min=1e-30)
            total = p.sum()
            # p == q exactly leaves nothing to sample from; that case was accepted with probability 1
            # above, so only rounding reaches here: fall back to the target row.
            p = p / total if total > 0 else target_probs[node]
        if accepted_child < 0:
            out.append(sample(p, generator).reshape(1).to(tree.tokens.device))
            break
        node = accepted_child
        path.append(node)
        out.append(tree.tokens[node : node + 1])
    return VerifyResult(path=torch.tensor(path, dtype=torch.long, device=tree.tokens.device), tokens=torch.cat(out))
