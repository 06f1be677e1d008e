"""The reduced draft vocabulary: the token ids a head's LM head scores.

Heads score only the most frequent tokens of their training data (EAGLE-3's d2t/t2d idea):
drafting and training then pay for a fraction of the full-vocabulary LM head. Exactness is
untouched, since verification and bonus tokens use the target's full vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence


def check_draft_vocab(ids: Sequence[int] | None, vocab_size: int, head_type: str) -> tuple[int, ...] | None:
    """The ids as a hashable tuple (JSON gives a list); they must be sorted, distinct and in the vocabulary."""
    if ids is None:
        return None
    out = tuple(int(i) for i in ids)
    if not out or list(out) != sorted(set(out)) or out[0] < 0 or out[-1] >= vocab_size:
        raise ValueError(f"{head_type} draft_vocab must be sorted, distinct token ids in [0, {vocab_size})")
    return out
