"""Lookahead decoding's n-gram pool: n-grams keyed by their first token, the most recently seen first.

The Jacobi window (`jacobi_window.py`) produces n-grams every step; the pool keeps, for each first token, the last
`per_key` distinct ones, and the verification branch drafts the continuations stored under the tree's root. Seeing an
n-gram again moves it to the front: the window's trajectories settle on the text the target keeps producing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class NgramPool:
    """N-grams of `size` tokens, at most `per_key` per first token; each is stored as its continuation (the tokens
    after the first)."""

    def __init__(self, size: int, per_key: int) -> None:
        assert size >= 2 and per_key >= 1, (size, per_key)
        self.size, self.per_key = size, per_key
        self._by_key: dict[int, OrderedDict[tuple[int, ...], None]] = {}  # key -> continuations, oldest first

    def __len__(self) -> int:
        return sum(len(c) for c in self._by_key.values())

    def add(self, ngram: Iterable[int]) -> None:
        """Keep `ngram` (`size` tokens) as the most recent under its first token, dropping that key's oldest past
        `per_key`."""
        key, *rest = (int(t) for t in ngram)
        assert len(rest) == self.size - 1, (len(rest), self.size)
        kept = self._by_key.setdefault(key, OrderedDict())
        cont = tuple(rest)
        kept[cont] = None
        kept.move_to_end(cont)
        if len(kept) > self.per_key:
            kept.popitem(last=False)

    def add_text(self, tokens: list[int]) -> None:
        """Every n-gram of `tokens`, in order (so a later occurrence is the more recent)."""
        for i in range(len(tokens) - self.size + 1):
            self.add(tokens[i : i + self.size])

    def continuations(self, key: int, count: int) -> list[tuple[int, ...]]:
        """Up to `count` continuations stored under `key`, the most recent first."""
        kept = self._by_key.get(int(key))
        if not kept:
            return []
        out = []
        for cont in reversed(kept):
            out.append(cont)
            if len(out) == count:
                break
        return out
