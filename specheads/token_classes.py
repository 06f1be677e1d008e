"""Token classes: what kind of text each token of a vocabulary is, defined once from the tokenizer's own strings.

Acceptance diagnosis (where and on what drafts get rejected) and training evaluation (top-1 by class) both ask
"what kind of token is this?"; they share these definitions, applied to each token's decoded text in this order:

- `end_of_turn`: the tokenizer's special tokens and the target's stop tokens (end of turn, end of text, ...);
- `whitespace`: only spaces, tabs and newlines (indentation, line breaks);
- `digits`: digits, possibly with `.` or `,` between them, after stripping whitespace;
- `structural`: only JSON/code structure characters `{ } [ ] " : , ; =` (and whitespace), e.g. `{"`, `":`, `},`;
- `punctuation`: no letter or digit at all (other punctuation and brackets: `(`, `)`, `.`, `!`, `->`, ...);
- `word`: anything else (word pieces, identifiers, text with letters).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

TOKEN_CLASSES = ("word", "whitespace", "punctuation", "structural", "digits", "end_of_turn")
STRUCTURAL_CHARS = frozenset('{}[]":,;=')


def text_class(text: str) -> str:
    """The class of a non-special token whose decoded text is `text`."""
    stripped = text.strip()
    if not stripped:
        return "whitespace" if text else "word"  # an empty decode is part of a multi-byte character
    if any(c.isdigit() for c in stripped) and all(c.isdigit() or c in ".," for c in stripped):
        return "digits"
    if all(c in STRUCTURAL_CHARS for c in stripped.replace(" ", "")):
        return "structural"
    if not any(c.isalnum() for c in stripped):
        return "punctuation"
    return "word"


@dataclass(frozen=True)
class TokenClasses:
    """The class of every token id of one vocabulary."""

    of_token: torch.Tensor  # [V] long: index into TOKEN_CLASSES

    def names(self, ids: torch.Tensor | Iterable[int]) -> list[str]:
        """The class names of `ids`."""
        index = ids.long() if torch.is_tensor(ids) else torch.tensor(list(ids), dtype=torch.long)
        return [TOKEN_CLASSES[i] for i in self.of_token[index].tolist()]

    def counts(self) -> dict[str, int]:
        """How many tokens of the vocabulary fall in each class."""
        found = torch.bincount(self.of_token, minlength=len(TOKEN_CLASSES)).tolist()
        return dict(zip(TOKEN_CLASSES, found))


def token_classes(tokenizer, vocab_size: int | None = None, stop_token_ids: Iterable[int] = ()) -> TokenClasses:
    """Classify every id below `vocab_size` (default: the tokenizer's length; a model's vocabulary may be padded past
    it: those ids are `word`) from the tokenizer's decoded strings."""
    size = len(tokenizer) if vocab_size is None else vocab_size
    known = min(size, len(tokenizer))
    texts = tokenizer.batch_decode([[i] for i in range(known)], clean_up_tokenization_spaces=False)
    special = set(tokenizer.all_special_ids) | {int(i) for i in stop_token_ids}
    index = {name: i for i, name in enumerate(TOKEN_CLASSES)}
    names = ["end_of_turn" if i in special else text_class(text) for i, text in enumerate(texts)]
    names += ["end_of_turn" if i in special else "word" for i in range(known, size)]  # rows past the tokenizer
    return TokenClasses(of_token=torch.tensor([index[n] for n in names], dtype=torch.long))
