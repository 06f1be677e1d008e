"""`specheads train ...`: runs the training recipe as its own module, so the engine never imports training code.

The passthrough takes its arguments unparsed (`main` hands it everything after `train`), so the recipe's own
parser answers `--help` and reports bad keys."""

from __future__ import annotations

import argparse
import os
import sys

NAME = "train"
HELP = "train heads: specheads train CONFIG.yaml [key=value ...] (same as python -m specheads.train)"
DESCRIPTION = None
ADD_HELP = False  # `specheads train --help` is the recipe's help


def add_arguments(p: argparse.ArgumentParser) -> None:
    """None: every argument goes to the recipe."""


def run(argv: list[str]) -> int:
    os.execv(sys.executable, [sys.executable, "-m", "specheads.train", *argv])
    return 0  # not reached
