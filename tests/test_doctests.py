"""Every example in the library's docstrings runs and prints what it says (the formulas' own worked cases)."""

import doctest
import importlib
import os

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
# The guest's bootstrap runs on import in the user's processes: it has no examples, and is never imported here.
SKIP = ("bootstrap",)


def _modules_with_examples() -> list[str]:
    found = []
    for folder, _, files in os.walk(os.path.join(SRC, "ddplab")):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and not any(part in path for part in SKIP) and ">>> " in open(path).read():
                module = os.path.relpath(path, SRC)[:-3].replace(os.sep, ".")
                found.append(module.removesuffix(".__init__"))
    return sorted(found)


@pytest.mark.parametrize("module", _modules_with_examples())
def test_the_docstrings_examples_hold(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0
