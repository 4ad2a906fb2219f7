"""A mergeable quantile sketch for rollups: a t-digest (fastdigest), kept and sent as its centroids.

Why fastdigest: measured with ``bench/sketch_choice.py`` (results in docs/performance.md) it was as
fast as datasketches' KLL to add a point and to merge 64 ranks, about ten times as accurate at p95/p99
(rank error <= 0.0003 against ~0.005 on lognormal data: tails are what a loss or step-time spike
moves), ships one small Rust wheel with no dependencies, and is maintained. ddsketch, pure Python, was
~10x slower to add a point and needs protobuf to serialise.

On the wire and in state a sketch is its centroids, ``{"means": [...], "weights": [...]}``: plain
JSON numbers that any t-digest implementation can rebuild, not one library's binary format. With at
most ``MAX_CENTROIDS`` centroids, a window of up to that many points is kept exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import fastdigest
import numpy as np

MAX_CENTROIDS = 100
QUANTILES = (0.5, 0.95, 0.99)


class Sketch:
    """Finite values only (the caller counts the rest). ``add``, ``merge``, ``quantile``, ``to_wire``.

    >>> s = Sketch(); s.add(np.arange(1.0, 101.0))
    >>> round(s.quantile(0.5)), s.count
    (50, 100)
    >>> t = Sketch.from_wire(s.to_wire()); t.merge(Sketch.of([1000.0])); t.count
    101
    """

    __slots__ = ("_digest",)

    def __init__(self, digest: fastdigest.TDigest | None = None):
        self._digest = digest if digest is not None else fastdigest.TDigest(max_centroids=MAX_CENTROIDS)

    @classmethod
    def of(cls, values: Iterable[float]) -> Sketch:
        values = [float(v) for v in values]
        if not values:
            return cls()
        # The centroids ``add`` on an empty sketch makes, at half the cost: every rollup builds one.
        return cls(fastdigest.TDigest.from_values(values, max_centroids=MAX_CENTROIDS))

    @property
    def count(self) -> int:
        return int(round(self._digest.mass()))

    def add(self, finite: np.ndarray) -> None:
        """Add finite values (a numpy array; the caller has dropped NaN and infinities)."""
        if len(finite):
            self._digest.batch_update(finite)

    def add_one(self, x: float) -> None:
        """Add one finite value (a window's usual case: one step per message, no numpy overhead)."""
        self._digest.update(x)

    def merge(self, other: Sketch) -> None:
        if other.count:
            self._digest.merge_inplace(other._digest)

    def quantile(self, q: float) -> float:
        return math.nan if not self.count else float(self._digest.quantile(q))

    def quantiles(self) -> tuple[float, ...]:
        if not self.count:
            return tuple(math.nan for _ in QUANTILES)
        quantile = self._digest.quantile
        return tuple(float(quantile(q)) for q in QUANTILES)

    def __eq__(self, other) -> bool:  # same centroids: windows and states compare by value
        return isinstance(other, Sketch) and self.to_wire() == other.to_wire()

    def __repr__(self) -> str:
        return f"Sketch(count={self.count})"

    def to_wire(self) -> dict[str, list[float]]:
        centroids = self._digest.centroids  # (mean, weight) pairs: half the cost of ``to_dict``
        return {"means": [m for m, _ in centroids], "weights": [w for _, w in centroids]}

    @classmethod
    def from_wire(cls, wire: Mapping | None) -> Sketch:
        """A sketch from ``to_wire``'s form; None or an empty form gives an empty sketch."""
        if not wire or not wire.get("means"):
            return cls()
        means, weights = wire["means"], wire["weights"]
        if len(means) != len(weights):
            raise ValueError("a sketch needs as many weights as means")
        centroids = [{"m": float(m), "c": float(c)} for m, c in zip(means, weights)]
        return cls(fastdigest.TDigest.from_dict({"max_centroids": MAX_CENTROIDS, "centroids": centroids}))
