"""Checks on the evaluation rows a training run writes to metrics.jsonl."""

from __future__ import annotations

import pytest


def assert_class_top1_adds_up(row: dict, overall: str) -> None:
    """An evaluation row's top-1 by token class, weighted by each class's share, is its first drafted token's top-1."""
    shares = {k.removeprefix("eval/share_"): v for k, v in row.items() if k.startswith("eval/share_")}
    assert shares and sum(shares.values()) == pytest.approx(1.0), row
    assert sum(v * row.get(f"eval/top1_{c}", 0.0) for c, v in shares.items()) == pytest.approx(row[overall]), row
