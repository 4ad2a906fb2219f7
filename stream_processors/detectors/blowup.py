from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rankwatch.stream_processors.detectors.calibration import THRESHOLD
from rankwatch.stream_processors.detectors.runs import PAIR_PRIOR
from rankwatch.stream_processors.detectors.spike import RobustSpike


class Blowup(RobustSpike):
    """A positive, heavy-tailed metric jumping by a large factor: ``spike`` upward only, on a log scale.

    KL divergence, importance-weight ratios, grad norms and losses live on multiplicative scales,
    where "ten times the usual" is the meaningful unit and a fall towards zero is no fault. Each
    point's ``log`` is compared with the median/MAD of the logs of the last ``window`` points, and
    only upward deviations count, scored and calibrated as ``spike`` scores them (a tail
    probability under the learned distribution of z). The log-scale sigma is floored at an eighth
    of ``log(min_factor)``, and a point less than ``min_factor`` times the rolling median never
    scores above a 3.5-sigma point (under the default threshold), however steady the metric was: a 1.5x wobble of a flat KL is no
    blow-up. Values at or below ``floor`` (zero, or a slightly negative KL estimate) are taken as
    ``floor``.

    Suits ``kl``, ``importance_weight`` / ``ratio_max``, ``grad_norm``, ``clip_fraction`` spikes.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> d = Blowup(window=32, warmup=16)
    >>> kl = np.r_[np.exp(rng.normal(np.log(0.01), 0.3, 200)), 0.002, 0.5]
    >>> d.decide(d.update(kl))[-3:].tolist()
    [False, False, True]
    """

    name = "blowup"
    severity = "critical"
    # "Ten times the usual" is against the usual level, not a line through a burst.
    follows_trend = False

    def __init__(
        self,
        *,
        window: int = 64,
        warmup: int = 40,
        threshold: float = THRESHOLD,
        min_factor: float = 3.0,
        floor: float = 1e-12,
        tail: float = 0.95,
        memory: int = 1000,
        rebase: int = 8,
        max_period: int = 300,
        history: Sequence[float] = (),
        calib: Sequence[Any] = (),
        run: int = 0,
        period: int = 0,
        seen: int = 0,
        marks: Sequence[int] = (),
        last_alarm: int = 0,
        held: bool = False,
        trending: bool = False,
        last_z: float = 0.0,
        pairs: Sequence[float] = (0.0, 0.0, PAIR_PRIOR[0] / PAIR_PRIOR[1]),
        moves: Sequence[Sequence[float]] = (),
        unit: float = 0.0,
        sizes: Sequence[float] = (),
    ):
        if min_factor <= 1 or floor <= 0:
            raise ValueError("need min_factor > 1 and floor > 0")
        super().__init__(
            window=window, warmup=warmup, threshold=threshold, direction="up", tail=tail, memory=memory,
            rebase=rebase, max_period=max_period, history=history, calib=calib, run=run, period=period, seen=seen,
            marks=marks, last_alarm=last_alarm, held=held, last_z=last_z, pairs=pairs, moves=moves, unit=unit,
            sizes=sizes,
        )
        self.min_factor, self.floor = min_factor, floor
        self._min_log_scale = math.log(min_factor) / 8.0  # a min_factor jump is z = 8 at least

    def _transform(self, values: np.ndarray) -> np.ndarray:
        return np.log(np.maximum(values, self.floor))

    def _floor(self, median: np.ndarray) -> np.ndarray:
        return np.full(len(median), self._min_log_scale)

    def _transform_one(self, value: float) -> float:
        return float(np.log(max(value, self.floor)))  # numpy's log, as ``_transform`` takes it

    def _floor_one(self, median: float) -> float:
        return self._min_log_scale

    def _adjust_one(self, z: float, point: float, center: float) -> float:
        return min(z, 3.5) if point - center < math.log(self.min_factor) else z

    def _resolution_floor(self, series: np.ndarray, first: int) -> float:
        return 0.0  # the log-scale floor above is far coarser than any reading's resolution

    def _resolution_floor_one(self, history: list[float], x: float) -> float:
        return 0.0

    def _adjust(self, z: np.ndarray, points: np.ndarray, center: np.ndarray) -> np.ndarray:
        # Below min_factor times the median a point counts as a 3.5-sigma one at most: rarer than one
        # in a thousand under the prior, yet under the default threshold (see the docstring).
        small = points - center < math.log(self.min_factor)
        return np.where(small, np.minimum(z, 3.5), z)

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "warmup": self.warmup,
            "threshold": self.threshold,
            "min_factor": self.min_factor,
            "floor": self.floor,
            "tail": self.tail,
            "memory": self.memory,
            "rebase": self.rebase,
            "max_period": self.max_period,
            "history": list(self.history),
            "calib": self.calib.state(),
            "run": self.run,
            "period": self.period,
            "seen": self.seen,
            "marks": list(self.marks),
            "last_alarm": self.last_alarm,
            "held": self.held,
            "trending": self.trending,
            "last_z": self.last_z,
            "pairs": list(self.pairs),
            "moves": [list(m) for m in self.moves],
            "unit": self.unit,
            "sizes": list(self.sizes),
        }
