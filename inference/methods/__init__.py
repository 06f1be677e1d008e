"""Decoding methods by name: the one table that `--method`, bench method specs and their options come from.

A method is declared in its own module of this package (`builtin.py` imports the built-in ones) and built by
the proposer module its `build` names, imported only when a proposer is made: declaring methods, listing them
and checking their options import no torch, so every command's `--help` answers at once. A drafter kind's
method carries the kind's name. A method declares its options as a frozen dataclass whose fields document
themselves (`option(help)`), so the command line's flags, their help and the check that a flag applies to
the chosen method are all derived from the registered options.
"""

# Importing the package registers the built-in methods, in builtin.py's order, whichever method module is imported
# first (a method module's import runs this package's first); method modules import `method.py`, not this package.
from specheads.inference.methods import builtin  # noqa: F401
from specheads.inference.methods.method import (
    METHODS,
    Build,
    DraftLoader,
    Method,
    OptionFlag,
    flag,
    make_proposer,
    method_label,
    option_flags,
    register_method,
)
from specheads.inference.methods.options import NoOptions, option

__all__ = ["METHODS", "Build", "DraftLoader", "Method", "NoOptions", "OptionFlag", "flag", "make_proposer",
           "method_label", "option", "option_flags", "register_method"]
