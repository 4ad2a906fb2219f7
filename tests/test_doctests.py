"""Every docstring example in the installed package runs, under the names users import."""

import doctest
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

# In an editable install the stages live in other folders than rankwatch/ itself, so each is walked
# from its own path.
ROOTS = ("rankwatch", "rankwatch.producers", "rankwatch.stream_processors", "rankwatch.sinks")


def _modules() -> list[str]:
    names = set()
    for root in ROOTS:
        package = importlib.import_module(root)
        names.add(root)
        names.update(info.name for info in pkgutil.walk_packages(package.__path__, root + "."))
    return sorted(name for name in names if not name.endswith("__main__"))


def _with_examples() -> list[str]:
    # Read the source rather than import: the trainer adapters import their (slow) trainers.
    return [name for name in _modules()
            if ">>>" in Path(importlib.util.find_spec(name).origin).read_text(encoding="utf-8")]


@pytest.mark.parametrize("name", _with_examples())
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


def test_every_stage_is_walked():
    found = _modules()
    for name in ("rankwatch.producers.publisher", "rankwatch.stream_processors.detectors.spike",
                 "rankwatch.sinks.webhook", "rankwatch.contract.telemetry"):
        assert name in found
