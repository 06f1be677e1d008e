"""The reduced draft vocabulary: the token ids a head's LM head scores.

Heads score only the most frequent tokens of their training data (EAGLE-3's d2t/t2d idea):
drafting and training then pay for a fraction of the full-vocabulary LM head. Exactness is
untouched, since verification and bonus tokens use the target's full vocabulary. speculators and SGLang
write the same mapping as `d2t` (target id = draft index + d2t[index]) and `t2d` (a mask over the target
vocabulary); `speculators_mappings` and `draft_vocab_from_d2t` convert.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_draft_vocab(ids: Sequence[int] | None, vocab_size: int, kind: str) -> tuple[int, ...] | None:
    """The ids as a hashable tuple (JSON gives a list); they must be sorted, distinct and in the vocabulary."""
    if ids is None:
        return None
    out = tuple(int(i) for i in ids)
    if not out or list(out) != sorted(set(out)) or out[0] < 0 or out[-1] >= vocab_size:
        raise ValueError(f"{kind} draft_vocab must be sorted, distinct token ids in [0, {vocab_size})")
    return out


def speculators_mappings(draft_vocab: tuple[int, ...], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """speculators' (d2t [Vd] int64 offsets, t2d [V] bool) for a sorted draft vocabulary."""
    ids = torch.tensor(draft_vocab, dtype=torch.long)
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(len(ids)), t2d


def draft_vocab_from_d2t(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of each draft row (speculators' and SGLang's d2t holds offsets: target = index + d2t[index])."""
    return d2t.long() + torch.arange(d2t.shape[0])
