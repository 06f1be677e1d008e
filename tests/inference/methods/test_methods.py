"""Method declarations: light to import, and each names a proposer builder that exists."""

from __future__ import annotations

import subprocess
import sys

import pytest

from specheads.inference.methods import METHODS, Method
from specheads.inference.methods.options import NoOptions


def test_declaring_and_listing_methods_imports_no_torch():
    code = ("import sys\nfrom specheads.inference.methods import METHODS, option_flags\n"
            "names = METHODS.names(); option_flags()\n"
            "print(len(names), 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(len(METHODS.names())), "False", "False"]


@pytest.mark.parametrize("name", METHODS.names())
def test_every_method_names_a_builder_that_resolves(name):
    method = METHODS.get(name)
    assert isinstance(method.build, str)  # the built-ins build lazily, so declaring them imports no torch
    assert callable(method.builder())


def test_a_malformed_builder_reference_is_refused_when_declared():
    with pytest.raises(TypeError, match="build must be 'package.module:function'"):
        Method(name="x", summary="", options=NoOptions, build="specheads.inference.engine.proposer")
