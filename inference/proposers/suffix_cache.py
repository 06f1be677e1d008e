"""The global cache of suffix decoding: finished requests' answers, shared by every row of an engine (so by every
request of a server), in one suffix tree.

Answers repeat across requests far more than within one: the same questions, templated replies, agents calling the
same tools with the same arguments. A request drafts from its own text and from this cache alike. Each answer is
held with the last `lead` tokens of the prompt it continued, so a request whose prompt ends like an earlier one's
matches from its first draft on (a repeated request drafts its whole answer).

Memory is bounded by `max_tokens`: adding an answer evicts whole answers, least recently used first, until the held
tokens fit. An answer is used when a draft is matched in its text. The tree holds at most `depth` nodes per token
(`suffix_tree.py`), so `max_tokens` bounds it too.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from specheads.inference.proposers.suffix_tree import Draft, DraftLimits, SuffixTree


class SuffixCache:
    """Finished answers, at most `max_tokens` tokens of them in all, in a suffix tree `depth` tokens deep."""

    def __init__(self, max_tokens: int, depth: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"the suffix cache needs max_tokens >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.tree = SuffixTree(depth)
        self.tokens = 0  # held now
        self._recent: OrderedDict[int, int] = OrderedDict()  # sequence id -> its length, least recently used first
        self._next = 0

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, text: Sequence[int]) -> None:
        """Hold `text` (an answer, led by the end of its prompt), evicting the least recently used answers until the
        held tokens fit `max_tokens`; a text longer than that keeps its last `max_tokens` tokens."""
        text = list(text)[-self.max_tokens:]
        if not text:
            return
        while self._recent and self.tokens + len(text) > self.max_tokens:
            seq, length = self._recent.popitem(last=False)
            self.tree.remove(seq)
            self.tokens -= length
        seq, self._next = self._next, self._next + 1
        self.tree.extend(seq, text)
        self.tree.close(seq)
        self._recent[seq] = len(text)
        self.tokens += len(text)

    def draft(self, context: Sequence[int], limits: DraftLimits) -> Draft:
        """The tree's best draft for `context`; the answer it was matched in counts as used."""
        draft = self.tree.draft(context, limits)
        if draft.seq in self._recent:
            self._recent.move_to_end(draft.seq)
        return draft
