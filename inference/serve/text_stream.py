"""Incremental detokenisation for streamed answers, with stop strings.

Text is released only once it is final: not while it ends in an incomplete UTF-8 character (the tokenizer decodes
a partial byte sequence to U+FFFD), and not while it ends in the beginning of a stop string, which the next tokens
may complete. A stop string ends the answer before it (as OpenAI's `stop`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop_strings = tokenizer, tuple(stop_strings)
        self.ids: list[int] = []
        self.text = ""  # the answer so far (up to a stop string, once one appeared)
        self.sent = 0  # characters of `text` released
        self.stopped = False  # a stop string appeared

    def add(self, new_ids: Sequence[int]) -> str:
        """Take a step's new tokens; return the text that became final (possibly "")."""
        if self.stopped:
            return ""
        self.ids.extend(int(t) for t in new_ids)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [i for i in (self.text.find(s, max(0, self.sent - len(s))) for s in self.stop_strings) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True
            return self._release(len(self.text))
        end = len(self.text)
        if self.text.endswith("\ufffd"):
            end -= 1
        for stop in self.stop_strings:  # hold back a tail that may grow into a stop string
            for k in range(min(len(stop) - 1, end - self.sent), 0, -1):
                if self.text[end - k : end] == stop[:k]:
                    end -= k
                    break
        return self._release(end)

    def flush(self) -> str:
        """The rest of the answer, once generation ended."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out
