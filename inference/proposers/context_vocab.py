"""A head's draft vocabulary grown by the tokens of the request it drafts for.

Heads score a reduced vocabulary, the most frequent tokens of their training data (see
`specheads.heads.draft_vocab`). The rare words a request brings fall outside it and can never be
drafted, and many of those already appear in the prompt or in earlier output (names, topic words,
identifiers; `scripts/lab/ablate_context_vocab.py` measures it, docs/results.md has the figures). The draft
LM head is the target's own frozen LM head restricted to some rows, so any other row scores a token just
as well: this class adds the rows of the tokens seen in the request, a few dozen to a few hundred, to the
rows the head was trained with.

Exactness does not depend on it (the verifier checks every draft against the target); it only
changes which tokens can be drafted.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from specheads.int8 import Int8Matrix
from specheads.target_logits import LogitMap


class ContextVocabulary:
    """Scores the draft vocabulary plus every token seen so far in the current request."""

    def __init__(self, lm_weight: torch.Tensor, draft_ids: torch.Tensor | None, enabled: bool = True,
                 int8: bool = False, logit_map: LogitMap = LogitMap()) -> None:
        """`lm_weight` [V, H] is the target's LM head; `draft_ids` [Vd] the head's sorted draft vocabulary
        (None: the whole vocabulary, nothing to add). With `enabled=False` only the draft vocabulary is scored.
        With `int8` the draft vocabulary's rows are scored in int8 (`specheads/int8.py`); added rows stay as
        they are. `logit_map` is what the target does to its LM head's output (`specheads.target_logits`)."""
        self._lm_weight = lm_weight
        self._map = logit_map
        self._base_ids = draft_ids
        self._base_weight = lm_weight if draft_ids is None else lm_weight[draft_ids]  # [Vd, H], gathered once
        self._base_int8 = Int8Matrix(self._base_weight) if int8 else None
        self.enabled = enabled and draft_ids is not None
        # Membership lives on the CPU, where the engine's committed tokens are: checking a step's few
        # tokens costs no device sync; only the rare new rows go to the weight's device.
        self._known = torch.zeros(lm_weight.shape[0], dtype=torch.bool)  # [V]
        self.reset(torch.zeros(0, dtype=torch.long))

    def fork(self) -> ContextVocabulary:
        """The same vocabulary for another request (the weights shared, its own scored tokens)."""
        new = copy.copy(self)
        new._known = torch.zeros_like(self._known)
        new.reset(torch.zeros(0, dtype=torch.long))
        return new

    @property
    def size(self) -> int:  # rows scored now: Vd + E
        return self._base_weight.shape[0] + self._extra_ids.shape[0]

    def reset(self, tokens: torch.Tensor) -> None:
        """Start a request whose text so far is `tokens` [T]."""
        device = self._lm_weight.device
        self._known.zero_()
        if self._base_ids is not None:
            self._known[self._base_ids.cpu()] = True
        self._extra_ids = torch.zeros(0, dtype=torch.long, device=device)  # [E]
        self._extra_weight = self._lm_weight[:0]  # [E, H]
        self._ids = self._base_ids  # [Vd + E] token id of each logit column
        self.add(tokens)

    def add(self, tokens: torch.Tensor) -> None:
        """Score `tokens` [n] from now on (no-op for those already scored)."""
        if not self.enabled or tokens.numel() == 0:
            return
        tokens = tokens.to("cpu", torch.long)
        new = tokens[~self._known[tokens]].unique()
        if new.numel() == 0:
            return
        self._known[new] = True
        new = new.to(self._lm_weight.device)
        self._extra_ids = torch.cat([self._extra_ids, new])
        self._extra_weight = torch.cat([self._extra_weight, self._lm_weight[new]])
        self._ids = torch.cat([self._base_ids, self._extra_ids])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, Vd + E], fp32
        # W @ hᵀ rather than h @ Wᵀ: for the 1-4 rows a draft level has, fp32 CPU GEMM runs faster in this
        # layout (it reads W as stored); the result is the same product.
        h = hidden.to(self._base_weight.dtype).T
        out = self._base_weight @ h if self._base_int8 is None else self._base_int8(hidden).T
        if self._extra_ids.numel():
            out = torch.cat([out, self._extra_weight @ h])
        return self._map(out.T.float())

    @staticmethod
    def logits_rows(vocabs: Sequence[ContextVocabulary], hidden: torch.Tensor) -> torch.Tensor:
        """[B, n, H] -> [B, n, Vd + max E] fp32: row b scored by vocabs[b] (one GEMM over the shared draft
        vocabulary for all rows), its columns past its own Vd + E_b at -inf."""
        first = vocabs[0]
        if any(v._base_weight is not first._base_weight or v._base_int8 is not first._base_int8 for v in vocabs):
            raise ValueError("rows scored together must share the draft vocabulary's weights")
        b, n, _ = hidden.shape
        flat = hidden.reshape(b * n, -1)
        base = (first._base_weight @ flat.to(first._base_weight.dtype).T if first._base_int8 is None
                else first._base_int8(flat).T)  # [Vd, B * n]: the layout `logits` explains
        base = first._map(base.T.float().reshape(b, n, -1))
        width = max(v._extra_ids.numel() for v in vocabs)
        if width == 0:
            return base
        extra = base.new_full((b, n, width), float("-inf"))
        for i, v in enumerate(vocabs):
            if v._extra_ids.numel():
                # mapped before the -inf padding joins them: a soft cap would lift -inf to a finite score
                extra[i, :, : v._extra_ids.numel()] = v._map((v._extra_weight
                                                              @ hidden[i].to(v._extra_weight.dtype).T).T.float())
        return torch.cat([base, extra], dim=-1)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:  # indices into logits' last dim -> token ids
        return index if self._ids is None else self._ids[index]
