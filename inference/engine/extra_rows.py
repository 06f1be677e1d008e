"""Rows a verify forward carries beside a draft tree's nodes that are never candidates for acceptance.

Lookahead decoding runs its Jacobi window in the same target forward as verification: the window's tokens are fed
after the tree's nodes, each at its own position and with its own attention pattern, and their outputs (the target's
next-token logits there) become the window's next guesses. The rows are inputs only: the verifier never sees them,
no node attends to them, and their KV entries sit in the cache slots after the nodes', which a commit never keeps (it
gathers the accepted path's entries behind the prefix and drops the rest). So whatever tokens they hold, the
committed output is what the tree alone gives.

An extra row attends to the committed prefix, the tree's root and the extra rows its `sees` row marks (itself
included); it sits at the root's position plus its `depths` entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExtraRows:
    tokens: torch.Tensor  # [E] long; the rows' input tokens
    depths: torch.Tensor  # [E] long, >= 1; a row's position is the root's plus its depth
    # sees[i, j]: row i attends to row j; each row sees itself and only earlier, shallower rows (so the rows up to
    # any depth are closed under what they see)
    sees: torch.Tensor  # [E, E] bool on CPU

    def __post_init__(self) -> None:
        e = self.tokens.shape[0]
        assert e >= 1 and self.depths.shape == (e,) and self.sees.shape == (e, e), \
            (self.tokens.shape, self.depths.shape, self.sees.shape)
        assert bool((self.depths >= 1).all()), "extra rows sit after the root"
        sees = self.sees
        assert sees.device.type == "cpu" and sees.dtype == torch.bool, (sees.device, sees.dtype)
        depths = self.depths.cpu()
        assert bool(sees.diagonal().all()) and not bool(sees.triu(1).any()), "a row sees itself and only rows before it"
        assert not bool((sees.tril(-1) & (depths[None, :] >= depths[:, None])).any()), "a row sees only shallower rows"

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def up_to(self, max_depth: int) -> ExtraRows | None:
        """The rows at depth <= max_depth (None if none)."""
        keep = (self.depths.cpu() <= max_depth).nonzero().squeeze(1)
        if keep.shape[0] == self.size:
            return self
        if keep.shape[0] == 0:
            return None
        return ExtraRows(tokens=self.tokens[keep.to(self.tokens.device)],
                         depths=self.depths[keep.to(self.depths.device)], sees=self.sees[keep][:, keep])

    def visible(self, num_nodes: int) -> torch.Tensor:  # [E, N + E] bool
        """Which inputs of a forward over `num_nodes` tree nodes, then these rows, each row sees: the root and the
        rows it `sees`, never another node."""
        out = torch.zeros(self.size, num_nodes + self.size, dtype=torch.bool)
        out[:, 0] = True
        out[:, num_nodes:] = self.sees
        return out
