"""Lookahead decoding's Jacobi window: `levels` iterations of guesses for the next `width` positions.

`guesses[l][j]` is iteration l's guess for the token at depth j + l below the tree's root (level 0 the oldest,
`guesses[0][0]` the root itself). Column j's cells form a chain of consecutive positions: level 0's cells 0..j,
then the cells of levels 1..l in column j. Fed in the verify forward as extra rows (`extra_rows.py`), each cell
attends to the prefix and the cells before it in its chain, so one forward is one Jacobi iteration of every column
at once; the target's argmax at the last level's cell in column j guesses the token at depth j + levels.

After a step that commits k tokens the root moves k positions on, and so does the window:

1. The last level's outputs form a new level (iteration `levels`); column j's trajectory, from level 0 to the new
   guess, is an n-gram of levels + 1 consecutive tokens, handed to the pool (`ngram_pool.py`).
2. Every level moves one down (the oldest is dropped) and k - 1 columns left, so each cell keeps guessing the same
   absolute position; cells left without a guess (the new level's, when its rows were not in the forward, and the
   columns shifted in from the right) take a token drawn from the prompt, as lookahead decoding starts its window.
"""

from __future__ import annotations

import random

import torch

from specheads.inference.engine.extra_rows import ExtraRows


class JacobiWindow:
    """A window of `width` columns and `levels` levels (>= 2), filled from `source` tokens drawn with a generator
    seeded by `seed`, so the same prompt gives the same window (a seeded sampled generation reproduces)."""

    def __init__(self, width: int, levels: int, source: list[int], seed: int = 0) -> None:
        assert width >= 1 and levels >= 2 and source, (width, levels, len(source))
        self.width, self.levels = width, levels
        self._source = source
        self._rng = random.Random(seed)
        self.guesses: list[list[int]] = [[self._fill() for _ in range(width)] for _ in range(levels)]
        # The cells fed as extra rows, in row order: level 0's columns 1.. (column 0 is the root), then each later
        # level's columns; a cell sees level 0's cells up to its column, then its column's cells up to its level.
        self.cells = [(0, j) for j in range(1, width)] + [(lv, j) for lv in range(1, levels) for j in range(width)]
        index = {cell: i for i, cell in enumerate(self.cells)}
        sees = torch.eye(len(self.cells), dtype=torch.bool)
        for i, (lv, j) in enumerate(self.cells):
            for c in range(1, j + 1):
                sees[i, index[(0, c)]] = True
            for k in range(1, lv + 1):
                sees[i, index[(k, j)]] = True
        self._depths = torch.tensor([lv + j for lv, j in self.cells], dtype=torch.long)
        self._sees = sees
        self._sent: list[int] = []  # the cells (indices into `cells`) of the last rows handed out

    @property
    def num_sent(self) -> int:
        """Rows handed out by the last `rows` and not yet answered by `advance`."""
        return len(self._sent)

    def _fill(self) -> int:
        return self._source[self._rng.randrange(len(self._source))]

    def rows(self, root: int, max_depth: int) -> ExtraRows | None:
        """The window's cells at depth <= max_depth as extra rows below `root` (None if none); the forward's outputs
        at them are what `advance` reads."""
        self.guesses[0][0] = int(root)
        rows = ExtraRows(tokens=torch.tensor([self.guesses[lv][j] for lv, j in self.cells], dtype=torch.long),
                         depths=self._depths, sees=self._sees).up_to(max_depth)
        self._sent = [] if rows is None else (self._depths <= max_depth).nonzero().squeeze(1).tolist()
        return rows

    def advance(self, committed: int, outputs: list[int] | None) -> list[list[int]]:
        """Move the window past `committed` (>= 1) new tokens; `outputs` are the target's argmax at the rows `rows`
        last handed out, in their order (None: no outputs this step, e.g. a plain step). Returns the n-grams
        (levels + 1 tokens each) of the columns whose trajectories reached a new guess."""
        assert committed >= 1, committed
        new: list[int | None] = [None] * self.width
        if outputs is not None:
            assert len(outputs) == len(self._sent), (len(outputs), len(self._sent))
            last = self.levels - 1
            for i, tok in zip(self._sent, outputs):
                lv, j = self.cells[i]
                if lv == last:
                    new[j] = int(tok)
        self._sent = []
        ngrams = [[self.guesses[lv][j] for lv in range(self.levels)] + [tok]
                  for j, tok in enumerate(new) if tok is not None]
        shift = committed - 1
        levels = self.guesses[1:] + [new]
        self.guesses = [[self._cell(level, j + shift) for j in range(self.width)] for level in levels]
        return ngrams

    def _cell(self, level: list[int | None], column: int) -> int:
        tok = level[column] if column < self.width else None
        return self._fill() if tok is None else tok
