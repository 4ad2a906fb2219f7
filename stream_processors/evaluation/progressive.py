"""Deciding how much to evaluate: stop an evaluation early, and how often to evaluate at all.

Both are advice. The processors publish it on ``rankwatch.control``; trainers follow it only when
configured to, within their own bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rankwatch.stream_processors.evaluation.stats import summarize, wilson_interval


def _fpc(n, population: int | None):
    """Finite population correction: how much of the sampling error is left after n of population."""
    if not population or population < 2:
        return np.ones_like(np.asarray(n, dtype=np.float64))
    return np.sqrt(np.maximum(0, population - np.asarray(n, dtype=np.float64)) / (population - 1))


@dataclass(frozen=True, kw_only=True)
class StopRule:
    """Stop when the 95% CI half-width of the primary metric is at most ``target``.

    What an early stop costs is the distance between the early mean and the mean the *full*
    evaluation would give, so when the dataset size is known the half-width carries the finite
    population correction sqrt((N - n) / (N - 1)): the last samples of a fixed set add less and
    less. Two guards keep it from stopping on luck: the Wilson interval, which stays wide near 0
    and 1 where a Wald interval collapses to nothing, and ``min_samples``. Samples must arrive in
    random order (the eval sampler keeps index order: shuffle a sorted validation set once
    beforehand), or the early mean is biased whatever its CI says.

    >>> rule = StopRule(target=0.02, min_samples=100)
    >>> values = np.r_[np.ones(900), np.zeros(100)]
    >>> rule.should_stop(values[::5], population=1000)   # 200 samples at 90%: ±4.2 points × 0.89
    False
    >>> rule.should_stop(values[::2], population=1000)   # 500 samples: ±2.6 points × 0.71
    True
    """

    target: float = 0.01
    min_samples: int = 200
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if self.target <= 0 or self.min_samples < 2:
            raise ValueError("target must be > 0 and min_samples >= 2")

    def half_width(self, values, population: int | None = None) -> float:
        s = summarize(values, self.confidence)
        if s.n < 2 or not math.isfinite(s.half_width):
            return math.inf
        return s.half_width * float(_fpc(s.n, population))

    def binary_half_widths(self, k, n, population: int | None = None) -> np.ndarray:
        """``half_width`` of 0/1 values from k successes in n, vectorised (for simulations)."""
        lo, hi = wilson_interval(k, n, self.confidence)
        return np.where(np.asarray(n) >= 2, (hi - lo) / 2 * _fpc(n, population), np.inf)

    def should_stop(self, values, population: int | None = None) -> bool:
        n = int(np.isfinite(np.asarray(values, dtype=np.float64)).sum())
        return n >= self.min_samples and self.half_width(values, population) <= self.target


@dataclass(frozen=True)
class IntervalAdvice:
    interval: int  # suggested steps between evaluations
    current: int  # the interval the run has been using (median gap of recent evaluations)
    swing: float  # scatter around the linear trend, in standard errors (about 1 when stable)
    drift: float  # trend per current interval, in standard errors

    @property
    def reason(self) -> str:
        return (f"metric swings {self.swing:.1f} SE around its trend and drifts {self.drift:.1f} SE per "
                f"{self.current} steps; evaluate every {self.interval} steps")


@dataclass(frozen=True, kw_only=True)
class IntervalAdvisor:
    """Suggest an evaluation interval from the trend and volatility of the primary metric.

    Over the last ``window`` evaluations it fits a line to the metric against the step, and
    measures the residual scatter (``swing``) and the slope over one interval (``drift``) in units
    of the evaluations' own standard errors, so sampling noise alone gives a swing near 1. While the
    metric swings (``swing >= swing_high``: large updates move it more than noise) evaluations say
    little about where training is heading, so the interval grows by ``factor``; once it is stable
    (``swing <= swing_low`` and ``drift <= drift_low``) it shrinks by ``factor``. Always within
    [``min_interval``, ``max_interval``].

    >>> advisor = IntervalAdvisor(min_interval=10, max_interval=1000)
    >>> steps = [100, 200, 300, 400, 500]
    >>> advisor.suggest(steps, [0.5, 0.8, 0.4, 0.9, 0.45], [0.01] * 5).interval
    200
    >>> advisor.suggest(steps, [0.800, 0.801, 0.799, 0.800, 0.801], [0.01] * 5).interval
    50
    """

    window: int = 6
    min_reports: int = 4
    swing_high: float = 3.0
    swing_low: float = 1.5
    drift_low: float = 1.0
    factor: float = 2.0
    min_interval: int = 10
    max_interval: int = 10_000

    def __post_init__(self) -> None:
        if not 1 <= self.min_interval <= self.max_interval:
            raise ValueError("need 1 <= min_interval <= max_interval")
        if self.min_reports < 3 or self.window < self.min_reports:
            raise ValueError("need 3 <= min_reports <= window")

    def suggest(self, steps, means, stderrs) -> IntervalAdvice | None:
        """None until ``min_reports`` evaluations at distinct steps are known."""
        steps = np.asarray(steps, dtype=np.float64)[-self.window:]
        means = np.asarray(means, dtype=np.float64)[-self.window:]
        stderrs = np.asarray(stderrs, dtype=np.float64)[-self.window:]
        ok = np.isfinite(steps) & np.isfinite(means)
        steps, means, stderrs = steps[ok], means[ok], stderrs[ok]
        if steps.size < self.min_reports or np.unique(steps).size < 3:
            return None
        current = int(max(1, np.median(np.diff(np.sort(steps)))))
        se = np.sqrt(np.nanmean(stderrs**2)) if np.any(np.isfinite(stderrs)) else 0.0
        se = max(float(se), 1e-12)
        slope, intercept = np.polyfit(steps, means, 1)
        residuals = means - (slope * steps + intercept)
        swing = float(np.sqrt(np.sum(residuals**2) / (steps.size - 2)) / se)
        drift = float(abs(slope) * current / se)
        interval = current
        if swing >= self.swing_high:
            interval = current * self.factor
        elif swing <= self.swing_low and drift <= self.drift_low:
            interval = current / self.factor
        interval = int(min(self.max_interval, max(self.min_interval, round(interval))))
        return IntervalAdvice(interval, current, swing, drift)
