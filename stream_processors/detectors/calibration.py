"""Calibrated scores: a detector's raw statistic turned into ``1 - P(statistic >= s)`` under what it learned.

A raw statistic (a robust |z|, a CUSUM sum) means different things on different metrics: a busy
host's step time routinely shows |z| = 6, a steady loss never does. ``TailModel`` learns the
statistic's own distribution on the series and scores a point by its survival probability, so a
score of 0.99 means "about one point in a hundred is at least this extreme here", on every metric,
and one threshold serves them all.

How: a histogram over ``log1p(s)`` (``BINS`` bins up to ``S_MAX``) with exponential forgetting
(``memory`` points), started from ``prior`` pseudo-points of a reference distribution the detector
supplies (half-normal for a |z|), so the first scores after warm-up are sensible and the prior
fades as data come in. Below the ``TAIL`` quantile the survival is read from the histogram; above
it, from a generalised Pareto tail fitted to the excesses by the method of moments (peaks over
threshold, as in Siffer et al., KDD 2017, "Anomaly detection in streams with extreme value
theory"), with its shape shrunk towards 0 and clipped to [0, 0.3]: that extrapolates to probabilities far below
``1 / memory`` without letting one huge past value make every later one look normal.

The model refits every ``REFIT`` learned points; the points in between wait in ``pending``, so the
state is the histogram plus at most ``REFIT`` numbers, and scoring a point is O(1).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
from scipy.special import ndtr

BINS = 64
S_MAX = 1e4
_T_MAX = math.log1p(S_MAX)
EDGES = np.expm1(np.linspace(0.0, _T_MAX, BINS + 1))
#: Quantile above which the survival is the fitted tail, not the histogram.
TAIL = 0.9
REFIT = 8
#: Pseudo-excesses of the exponential tail (shape 0) that the fitted shape is shrunk towards.
SHAPE_PRIOR = 100.0
MAX_SHAPE = 0.3

#: The default alert threshold of every calibrated detector: a tail probability of 1e-6 per point.
#: A rank publishes about ten metrics that rules watch and the goal is at most one false alert per
#: 10,000 rank-steps; at 1e-4 the clean recorded runs of the tuning part (``bench/corpus.py``) gave
#: 2 false spike alerts per 3,500 rank-steps, at 1e-6 none.
THRESHOLD = 0.999999


def half_normal_sf(s: np.ndarray) -> np.ndarray:
    """P(|Z| >= s) for a standard normal Z: the prior of a robust |z|."""
    return 2.0 * ndtr(-np.asarray(s, dtype=np.float64))


def exponential_sf(s: np.ndarray) -> np.ndarray:
    """P(S >= s) = exp(-s): a prior for a one-sided accumulated statistic in units of its limit."""
    return np.exp(-np.asarray(s, dtype=np.float64))


def prior_counts(sf: Callable[[np.ndarray], np.ndarray], weight: float) -> list[float]:
    """``weight`` pseudo-points spread over the bins as the distribution with survival ``sf``."""
    surv = sf(EDGES)
    mass = np.r_[surv[:-1] - surv[1:]]
    mass[-1] += surv[-1]
    return (weight * mass / max(mass.sum(), 1e-300)).tolist()


class TailModel:
    """The learned distribution of a non-negative statistic; ``score(s) = 1 - P(S >= s)``."""

    def __init__(self, counts: Sequence[float], pending: Sequence[float] = (), *, memory: int = 1000):
        if len(counts) != BINS:
            raise ValueError(f"a tail model has {BINS} bin counts")
        self.counts = [float(c) for c in counts]
        self.pending = [float(p) for p in pending][:REFIT]
        self.memory = memory
        self._fit()

    def state(self) -> list:
        return [list(self.counts), list(self.pending)]

    def _fit(self) -> None:
        counts = np.asarray(self.counts)
        total = counts.sum()
        # Survival at each edge: the mass of the bins at or above it.
        sf = np.r_[np.cumsum(counts[::-1])[::-1], 0.0] / total
        self._sf = sf.tolist()
        k = int(np.argmax(sf <= 1.0 - TAIL))  # the first edge whose survival is within the tail
        k = max(k, 1)
        self._u, self._sf_u = float(EDGES[k]), float(sf[k])
        tail = counts[k:]
        mids = np.r_[0.5 * (EDGES[k:-1] + EDGES[k + 1 :]), EDGES[-1]][: len(tail)] - self._u
        weight = tail.sum()
        if weight <= 0:
            # Nothing was ever above u: decay like the last bin below it, a conservative guess.
            self._xi, self._sigma = 0.0, max(float(EDGES[k] - EDGES[k - 1]), 1e-3)
            return
        mean = float((tail * mids).sum() / weight)
        var = float((tail * (mids - mean) ** 2).sum() / weight)
        # The width of a bin is the resolution: excesses cannot be told apart more finely.
        mean = max(mean, 0.5 * float(EDGES[k + 1] - EDGES[k]) if k < BINS else mean, 1e-3)
        xi = 0.5 * (1.0 - mean * mean / var) if var > 0 else 0.0
        # The moment estimate of the shape is noisy from the ~100 excesses of a 1,000-point memory,
        # and a heavy tail read into thin data makes a 10-sigma point look ordinary: shrink it
        # towards the exponential tail by the amount of evidence, and cap it.
        xi *= weight / (weight + SHAPE_PRIOR)
        self._xi = min(max(xi, 0.0), MAX_SHAPE)
        self._sigma = mean * (1.0 - self._xi)

    def survival(self, s: float) -> float:
        """P(S >= s) under the model."""
        if not s > 0.0:
            return 1.0
        if s >= self._u:
            z = (s - self._u) / self._sigma
            if self._xi > 0:
                return self._sf_u * math.exp(-math.log1p(self._xi * z) / self._xi) if z < 1e300 else 0.0
            return self._sf_u * math.exp(-z) if z < 1e3 else 0.0
        t = math.log1p(s) / _T_MAX * BINS
        i = min(int(t), BINS - 1)
        frac = t - i
        return self._sf[i] + frac * (self._sf[i + 1] - self._sf[i])

    def score(self, s: float) -> float:
        return 1.0 - self.survival(s)

    def learn(self, s: float) -> None:
        if not math.isfinite(s):
            s = S_MAX
        self.pending.append(min(max(s, 0.0), S_MAX))
        if len(self.pending) < REFIT:
            return
        decay = (1.0 - 1.0 / self.memory) ** len(self.pending)
        counts = [c * decay for c in self.counts]
        for p in self.pending:
            counts[min(int(math.log1p(p) / _T_MAX * BINS), BINS - 1)] += 1.0
        self.counts, self.pending = counts, []
        self._fit()

    def quantile(self, p: float) -> float:
        """The statistic whose survival is ``p``: the smallest value that scores ``1 - p``."""
        if p <= self._sf_u:
            ratio = self._sf_u / max(p, 1e-300)
            if self._xi > 0:
                return self._u + self._sigma / self._xi * math.expm1(self._xi * math.log(ratio))
            return self._u + self._sigma * math.log(ratio)
        # In the body: the edges' survivals fall from 1 to sf_u; interpolate as ``survival`` does.
        for i in range(BINS):
            hi, lo = self._sf[i], self._sf[i + 1]
            if lo <= p <= hi and hi > lo:
                t = (i + (hi - p) / (hi - lo)) / BINS * _T_MAX
                return math.expm1(t)
        return self._u

    def update(self, s: float, threshold: float) -> float:
        """Score ``s``, then learn it; beyond ``threshold`` it is learned only up to the threshold's
        quantile, so a deviation that recurs becomes normal and one fault cannot make faults normal."""
        score = self.score(s)
        self.learn(min(s, self.quantile(1.0 - threshold)) if score >= threshold else s)
        return score
