"""Validation that composes itself: a settings dataclass built from several parts (a kind's block, the recipe's
objective settings, the fused-layer keys) runs every part's check exactly once, with no call written by hand.

Each class states only its own rules, in a `_check(self)` method; `Checked.__post_init__` walks the instance's MRO
from the root down and calls every class's own `_check` (the one in that class's `__dict__`, never an inherited one).
So a class mixing several parts cannot skip one of their checks or run one twice, and a subclass's rules run after
those of the classes it extends (they may rely on what those checked or normalised). The walk is the order in which
`dataclasses` collects the fields, so the parts are checked in the order their fields are listed.
Work after `__init__` (normalising a field with `object.__setattr__`) belongs in `_check` too: a `__post_init__`
below `Checked` is refused, since it would silently replace the walk.
"""

from __future__ import annotations

from typing import Any


class Checked:
    """Base of settings dataclasses whose validation composes: define `_check(self) -> None` (raising ValueError
    naming the fix) in each class, never `__post_init__`."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__post_init__" in cls.__dict__:
            raise TypeError(f"{cls.__qualname__} defines __post_init__, which would replace the checks of the classes "
                            "it extends; move its body to a _check(self) method (specheads.checked)")

    def __post_init__(self) -> None:
        for cls in reversed(type(self).__mro__):  # root first: a class's rules run after those it extends
            check = cls.__dict__.get("_check")
            if check is not None:
                check(self)
