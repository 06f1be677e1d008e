"""Top-1 by token class in training evaluation: whether more steps help structure (brackets, indentation, digits)
or prose, with the classes `specheads bench --diagnose` reports rejections by (`specheads.token_classes`).

An objective's `eval_sums` may add, under `TOKEN_HITS`, a `TokenHits` of every draft token it scored: the token the
target wanted there, whether the draft's top-1 was it, and its draft position. The recipe classifies them with the
target tokenizer's classes, sums them with the other evaluation sums (over batches and processes) and adds
`eval/top1_<class>` (first drafted token), `eval/top1_<class>_step<k>` (the k-th drafted token) and
`eval/share_<class>` (the class's share of the scored first tokens) to the evaluation row. A class with no scored
token at a position gets no metric there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.token_classes import TOKEN_CLASSES, TokenClasses

TOKEN_HITS = "token_hits"  # the key of an objective's `TokenHits` in what its `eval_sums` returns
CLASS_HITS, CLASS_POSITIONS = "class_hits", "class_positions"


@dataclass(frozen=True)
class TokenHits:
    """Every draft token one evaluation batch scored."""

    wanted: torch.Tensor  # [M] long: the target's token (full-vocabulary id) the draft had to match
    hit: torch.Tensor  # [M] bool: the draft's top-1 was `wanted`
    position: torch.Tensor  # [M] long: 0 for the first drafted token, k - 1 for the k-th
    depth: int  # how many draft positions the objective scores (the same in every batch, so sums add up)

    def __post_init__(self) -> None:
        if not (self.wanted.shape == self.hit.shape == self.position.shape) or self.wanted.dim() != 1:
            raise ValueError(f"TokenHits wants three [M] tensors, got wanted {tuple(self.wanted.shape)}, "
                             f"hit {tuple(self.hit.shape)}, position {tuple(self.position.shape)}")


def token_hits(wanted: torch.Tensor, hit: torch.Tensor, position: torch.Tensor | int, depth: int,
               keep: torch.Tensor | None = None) -> TokenHits:
    """`TokenHits` from same-shaped `wanted`/`hit` (and `position`, or one position for all), kept where `keep`."""
    position = torch.full_like(wanted, position) if isinstance(position, int) else position.expand_as(wanted)
    if keep is not None:
        wanted, hit, position = wanted[keep], hit[keep], position[keep]
    return TokenHits(wanted.reshape(-1).long(), hit.reshape(-1).bool(), position.reshape(-1).long(), depth)


def join_hits(parts: list[TokenHits], depth: int) -> TokenHits:
    """Several `TokenHits` of one batch (e.g. one per draft step; none when it scored nothing) as one."""
    if not parts:
        empty = torch.zeros(0, dtype=torch.long)
        return TokenHits(empty, empty.bool(), empty, depth)
    return TokenHits(torch.cat([p.wanted for p in parts]), torch.cat([p.hit for p in parts]),
                     torch.cat([p.position for p in parts]), depth)


def class_sums(hits: TokenHits, classes: TokenClasses) -> dict[str, torch.Tensor]:
    """{CLASS_HITS, CLASS_POSITIONS}: [depth, classes] counts of right top-1s and of scored tokens."""
    num = len(TOKEN_CLASSES)
    cell = hits.position.cpu() * num + classes.of_token[hits.wanted.cpu()]  # [M] flat (position, class) index
    size = hits.depth * num
    return {CLASS_HITS: torch.bincount(cell[hits.hit.cpu()], minlength=size).float().reshape(hits.depth, num),
            CLASS_POSITIONS: torch.bincount(cell, minlength=size).float().reshape(hits.depth, num)}


def class_row(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """The `eval/...` metrics of summed `class_sums`; {} when the objective scored no `TokenHits`."""
    if CLASS_POSITIONS not in sums:
        return {}
    hits, positions = sums[CLASS_HITS], sums[CLASS_POSITIONS]  # [depth, classes]
    row: dict[str, float] = {}
    first = float(positions[0].sum())
    for k in range(positions.shape[0]):
        suffix = "" if k == 0 else f"_step{k + 1}"
        for c, name in enumerate(TOKEN_CLASSES):
            if positions[k, c] > 0:
                row[f"eval/top1_{name}{suffix}"] = float(hits[k, c] / positions[k, c])
    for c, name in enumerate(TOKEN_CLASSES):
        if first > 0:
            row[f"eval/share_{name}"] = float(positions[0, c]) / first
    return row
