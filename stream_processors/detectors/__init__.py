"""Detectors: pure numpy/scipy, one interface (see ``base``), no Kafka or Faust.

Every detector scores points in [0, 1] (higher is more anomalous, warm-up scores 0) and decides
with its ``threshold``. ``BY_NAME`` maps each detector's ``name`` (as rule files and alert keys
spell it) to its class; ``build(name, **params)`` makes one with clear errors.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

from rankwatch.stream_processors.detectors.base import Detector
from rankwatch.stream_processors.detectors.blowup import Blowup
from rankwatch.stream_processors.detectors.collapse import Collapse
from rankwatch.stream_processors.detectors.crossrank import CrossRank
from rankwatch.stream_processors.detectors.cusum import Cusum
from rankwatch.stream_processors.detectors.ensemble import Ensemble
from rankwatch.stream_processors.detectors.ewma import EwmaResidual
from rankwatch.stream_processors.detectors.explode import Explode
from rankwatch.stream_processors.detectors.nonfinite import NonFinite
from rankwatch.stream_processors.detectors.page_hinkley import PageHinkley
from rankwatch.stream_processors.detectors.spike import RobustSpike
from rankwatch.stream_processors.detectors.stall import Stall, Stalled
from rankwatch.stream_processors.detectors.trend import Plateau, Trend

BY_NAME: dict[str, type[Detector]] = {
    cls.name: cls
    for cls in (
        NonFinite, RobustSpike, EwmaResidual, Cusum, PageHinkley, Trend, Plateau,
        Collapse, Blowup, Explode, CrossRank, Stall, Ensemble,
    )
}


@lru_cache(maxsize=None)
def _parameters(cls: type[Detector]) -> Mapping[str, inspect.Parameter]:
    # A worker builds every detector of every (rank, metric) it sees; inspect.signature is slow.
    return inspect.signature(cls.__init__).parameters


def build(name: str, **params: Any) -> Detector:
    """The detector called ``name`` with keyword ``params``; ValueError names the valid choices."""
    try:
        cls = BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown detector {name!r}; choose from {', '.join(sorted(BY_NAME))}") from None
    signature = _parameters(cls)
    for key, value in params.items():
        if key not in signature or key == "self":
            known = ", ".join(k for k, p in signature.items() if p.kind is p.KEYWORD_ONLY)
            raise ValueError(f"{name} has no parameter {key!r}; it has: {known}")
        default = signature[key].default
        # Defaults are the type contract: a number stays a number (ints count), a flag a bool.
        if isinstance(default, bool):
            ok, kind = isinstance(value, bool), "true or false"
        elif isinstance(default, (int, float)):
            ok, kind = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
        elif isinstance(default, str):
            ok, kind = isinstance(value, str), "text"
        else:
            ok, kind = True, ""
        if not ok:
            raise ValueError(f"{name}: {key} must be {kind}, not {value!r}")
    return cls(**params)


__all__ = [
    "BY_NAME",
    "Blowup",
    "Collapse",
    "CrossRank",
    "Cusum",
    "Detector",
    "Ensemble",
    "EwmaResidual",
    "Explode",
    "NonFinite",
    "PageHinkley",
    "Plateau",
    "RobustSpike",
    "Stall",
    "Stalled",
    "Trend",
    "build",
]
