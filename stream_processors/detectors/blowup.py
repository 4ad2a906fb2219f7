from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy.special import ndtri

from rankwatch.stream_processors.detectors.spike import RobustSpike


class Blowup(RobustSpike):
    """A positive, heavy-tailed metric jumping by a large factor: ``spike`` upward only, on a log scale.

    KL divergence, importance-weight ratios, grad norms and losses live on multiplicative scales,
    where "ten times the usual" is the meaningful unit and a fall towards zero is no fault. Each
    point's ``log`` is compared with the median/MAD of the logs of the last ``window`` points, and
    only upward deviations count: ``score = 2*Phi(z / z_scale) - 1``, default threshold 0.99
    (z > 7.7), with ``spike``'s tail-aware unit. The log-scale sigma is floored so that nothing below ``min_factor`` times the
    rolling median can reach the threshold, however steady the metric was. Values at or below
    ``floor`` (zero, or a slightly negative KL estimate) are taken as ``floor``.

    Suits ``kl``, ``importance_weight`` / ``ratio_max``, ``grad_norm``, ``clip_fraction`` spikes.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> d = Blowup(window=32, warmup=16)
    >>> kl = np.r_[np.exp(rng.normal(np.log(0.01), 0.3, 40)), 0.002, 0.5]
    >>> d.decide(d.update(kl))[-3:].tolist()
    [False, False, True]
    """

    name = "blowup"
    severity = "critical"

    def __init__(
        self,
        *,
        window: int = 64,
        warmup: int = 20,
        z_scale: float = 3.0,
        threshold: float = 0.99,
        min_factor: float = 3.0,
        floor: float = 1e-12,
        tail: float = 0.95,
        history: Sequence[float] = (),
    ):
        if min_factor <= 1 or floor <= 0:
            raise ValueError("need min_factor > 1 and floor > 0")
        super().__init__(window=window, warmup=warmup, z_scale=z_scale, threshold=threshold, direction="up", tail=tail)
        self.min_factor, self.floor = min_factor, floor
        self.history = [float(v) for v in history][-window:]  # already on the log scale
        # The log-scale sigma at which a jump of exactly min_factor scores the threshold.
        self._min_log_scale = math.log(min_factor) / (z_scale * float(ndtri((1.0 + threshold) / 2.0)))

    def _transform(self, values: np.ndarray) -> np.ndarray:
        return np.log(np.maximum(values, self.floor))

    def _floor(self, median: np.ndarray) -> np.ndarray:
        return np.full(len(median), self._min_log_scale)

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "warmup": self.warmup,
            "z_scale": self.z_scale,
            "threshold": self.threshold,
            "min_factor": self.min_factor,
            "floor": self.floor,
            "tail": self.tail,
            "history": list(self.history),
        }
