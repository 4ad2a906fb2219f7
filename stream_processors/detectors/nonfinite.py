from __future__ import annotations

from typing import Any

import numpy as np

from rankwatch.stream_processors.detectors.base import Detector


class NonFinite(Detector):
    """NaN or ±infinity: score 1 at once, no warm-up. A diverged run needs no statistics.

    Examples
    --------
    >>> NonFinite().update(np.array([1.0, float("nan"), 2.0, float("inf")]))
    array([0., 1., 0., 1.])
    """

    name = "nonfinite"
    threshold = 1.0
    severity = "critical"
    level_relative = False

    def score(self, values: np.ndarray) -> np.ndarray:
        return (~np.isfinite(np.asarray(values, dtype=np.float64))).astype(np.float64)

    def learn(self, values: np.ndarray) -> None:
        pass  # stateless

    def update(self, values: np.ndarray) -> np.ndarray:
        return self.score(values)

    def state_dict(self) -> dict[str, Any]:
        return {}
