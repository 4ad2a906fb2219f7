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
from collections.abc import Callable, Iterable, Sequence

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


#: Each bin's midpoint: where the tail fit places the excesses that fell in it.
_MIDS = 0.5 * (EDGES[:-1] + EDGES[1:])
_BIN = np.arange(BINS)


def bin_of(s: np.ndarray) -> np.ndarray:
    """The histogram bin of each learned value (in [0, S_MAX])."""
    return np.minimum((np.log1p(s) * (BINS / _T_MAX)).astype(np.int64), BINS - 1)


def fit_rows(counts: np.ndarray) -> tuple[np.ndarray, ...]:
    """The fitted model of each row of bin counts (``TailModel`` below, one row per refit): the
    survival at each edge, ``u``, the survival at ``u``, the tail's shape and scale. Rows are fitted
    independently and each alike whatever the others, so a batch of refits gives what one at a time does."""
    counts = np.asarray(counts, dtype=np.float64).reshape(-1, BINS)
    rows = np.arange(len(counts))
    total = counts.sum(axis=1)
    # Survival at each edge: the mass of the bins at or above it.
    sf = np.zeros((len(counts), BINS + 1))
    sf[:, :BINS] = np.cumsum(counts[:, ::-1], axis=1)[:, ::-1]
    sf /= total[:, None]
    k = np.maximum(np.argmax(sf <= 1.0 - TAIL, axis=1), 1)  # the first edge whose survival is within the tail
    u, sf_u = EDGES[k], sf[rows, k]
    tail = np.where(_BIN >= k[:, None], counts, 0.0)
    mids = _MIDS - u[:, None]
    weight = tail.sum(axis=1)
    some = weight > 0
    safe = np.where(some, weight, 1.0)
    mean = (tail * mids).sum(axis=1) / safe
    var = (tail * (mids - mean[:, None]) ** 2).sum(axis=1) / safe
    # The width of a bin is the resolution: excesses cannot be told apart more finely.
    half_bin = np.where(k < BINS, 0.5 * (EDGES[np.minimum(k + 1, BINS)] - EDGES[k]), mean)
    mean = np.maximum(np.maximum(mean, half_bin), 1e-3)
    with np.errstate(divide="ignore", invalid="ignore"):
        xi = np.where(var > 0, 0.5 * (1.0 - mean * mean / var), 0.0)
    # The moment estimate of the shape is noisy from the ~100 excesses of a 1,000-point memory,
    # and a heavy tail read into thin data makes a 10-sigma point look ordinary: shrink it
    # towards the exponential tail by the amount of evidence, and cap it.
    xi = np.clip(xi * (weight / (weight + SHAPE_PRIOR)), 0.0, MAX_SHAPE)
    sigma = mean * (1.0 - xi)
    # Nothing was ever above u: decay like the last bin below it, a conservative guess.
    xi = np.where(some, xi, 0.0)
    sigma = np.where(some, sigma, np.maximum(EDGES[k] - EDGES[k - 1], 1e-3))
    return sf, u, sf_u, xi, sigma


def survival_rows(s: np.ndarray, sf: np.ndarray, u: np.ndarray, sf_u: np.ndarray, xi: np.ndarray,
                  sigma: np.ndarray) -> np.ndarray:
    """``TailModel.survival`` of each ``s[i]`` under the model in row ``i`` of ``fit_rows``' output."""
    out = np.ones(len(s))
    beyond = s >= u  # NaN and s <= 0 survive with probability 1
    body = np.flatnonzero((s > 0.0) & ~beyond)
    if len(body):
        t = np.log1p(s[body]) * (BINS / _T_MAX)
        i = np.minimum(t.astype(np.int64), BINS - 1)
        lo, hi = sf[body, i], sf[body, i + 1]
        out[body] = lo + (t - i) * (hi - lo)
    far = np.flatnonzero(beyond & (s > 0.0))
    if len(far):
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            z = (s[far] - u[far]) / sigma[far]
            x = xi[far]
            heavy = np.where(z < 1e300, np.exp(-np.log1p(x * z) / np.where(x > 0, x, 1.0)), 0.0)
            light = np.where(z < 1e3, np.exp(-z), 0.0)
        out[far] = sf_u[far] * np.where(x > 0, heavy, light)
    return out


class TailModel:
    """The learned distribution of a non-negative statistic; ``score(s) = 1 - P(S >= s)``.

    ``update_many`` scores and learns a whole array at once, with the result of ``update`` on each
    value in turn: between two refits the model is fixed, and the refits of a batch are fitted
    together (``fit_rows``)."""

    def __init__(self, counts: Sequence[float], pending: Sequence[float] = (), *, memory: int = 1000):
        if len(counts) != BINS:
            raise ValueError(f"a tail model has {BINS} bin counts")
        self.counts = np.array(counts, dtype=np.float64)
        self.pending = [float(p) for p in pending][:REFIT]
        self.memory = memory
        self._keep = 1.0 - 1.0 / memory
        self.due = False  # the counts changed since the last fit: fit before the next read (``fit_due``)
        self._set(fit_rows(self.counts), 0)

    def state(self) -> list:
        return [self.counts.tolist(), list(self.pending)]

    def _set(self, fit: tuple[np.ndarray, ...], row: int) -> None:
        sf, u, sf_u, xi, sigma = fit
        self.due = False
        # For survival_rows; copies, since a view would keep a whole batch's fit (``fit_due``) alive.
        self._fit_row = tuple(a[row : row + 1].copy() for a in fit)
        self._sf = sf[row].tolist()
        self._u, self._sf_u, self._xi, self._sigma = float(u[row]), float(sf_u[row]), float(xi[row]), float(sigma[row])

    def _decayed(self, counts: np.ndarray, learned: np.ndarray) -> np.ndarray:
        """The counts after a refit on ``learned``: old mass forgotten per point, one count per point."""
        return counts * self._keep ** len(learned) + np.bincount(bin_of(learned), minlength=BINS)

    def _fitted(self) -> None:
        if self.due:
            self._set(fit_rows(self.counts), 0)

    def survival(self, s: float) -> float:
        """P(S >= s) under the model."""
        self._fitted()
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

    def score_many(self, s: np.ndarray) -> np.ndarray:
        """``score`` of each value, as ``update_many`` scores them (numpy's float functions, not math's)."""
        s = np.asarray(s, dtype=np.float64)
        self._fitted()
        return 1.0 - survival_rows(s, *(p[np.zeros(len(s), dtype=np.int64)] for p in self._fit_row))

    def learn(self, s: float) -> None:
        if not math.isfinite(s):
            s = S_MAX
        self.pending.append(min(max(s, 0.0), S_MAX))
        if len(self.pending) < REFIT:
            return
        self.counts = self._decayed(self.counts, np.asarray(self.pending))
        self.pending = []
        self.due = True  # fitted when the model is next read, or with other models by ``fit_due``

    def quantile(self, p: float) -> float:
        """The statistic whose survival is ``p``: the smallest value that scores ``1 - p``."""
        self._fitted()
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

    def update_many(self, s: np.ndarray, threshold: float) -> np.ndarray:
        """``update(v, threshold)`` for each ``v`` of ``s`` in order; returns the scores."""
        return self.update_probed(s, threshold, 0.0)[0]

    def update_probed(self, s: np.ndarray, threshold: float, probe: float,
                      learn: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``update_many``, and the survival of ``probe`` under the model that scored each value
        (what ``survival(probe)`` said just before the value was learned). Where ``learn`` is False
        a value is scored, not learned.

        Optimistic: every refit of the batch is fitted at once, assuming no value reaches the
        threshold (on clean data one in a million does). From the first block that holds one, the
        batch is taken again with that block learned clipped, as ``update`` learns it.
        """
        s = np.asarray(s, dtype=np.float64)
        if learn is not None and not learn.all():
            return self._update_some(s, threshold, probe, learn)
        scores = np.empty(len(s))
        probed = np.empty(len(s))
        done = 0
        while done < len(s):
            self._fitted()  # a clipped block below learns point by point
            rest = s[done:]
            learned = np.clip(np.where(np.isfinite(rest), rest, S_MAX), 0.0, S_MAX)
            # Refits happen after the values before each of ``ends`` are learned.
            ends = list(range(max(REFIT - len(self.pending), 1), len(rest) + 1, REFIT))
            rows = []
            if ends:
                # Each refit's new counts at once (as ``_decayed`` makes them one refit at a time).
                refitted = np.concatenate([self.pending, learned[: ends[-1]]])
                sizes = [len(self.pending) + ends[0]] + [REFIT] * (len(ends) - 1)
                block = np.repeat(np.arange(len(ends)), sizes)
                added = np.bincount(block * BINS + bin_of(refitted), minlength=len(ends) * BINS)
                counts = self.counts
                for size, new in zip(sizes, added.reshape(len(ends), BINS)):
                    counts = counts * self._keep**size + new
                    rows.append(counts)
            fits = fit_rows(np.array(rows)) if rows else None
            # The model each value is scored under: 0 the present one, j + 1 the one after refit j.
            which = np.searchsorted(np.asarray(ends, dtype=np.int64), np.arange(len(rest)), side="right")
            if fits is None:
                params = self._fit_row
                which = np.zeros(len(rest), dtype=np.int64)
            else:
                params = tuple(np.concatenate([p, q]) for p, q in zip(self._fit_row, fits))
            got = 1.0 - survival_rows(rest, *(p[which] for p in params))
            at = survival_rows(np.full(len(rest), probe), *(p[which] for p in params))
            hits = np.flatnonzero(got >= threshold)
            if not len(hits):
                scores[done:] = got
                probed[done:] = at
                if rows:
                    self.counts = rows[-1]
                    self._set(fits, len(rows) - 1)
                    self.pending = learned[ends[-1] :].tolist()
                else:
                    self.pending += learned.tolist()
                return scores, probed
            # The first block that holds a hit: the blocks before it stand, and its scores too (they
            # were scored under the model before it); it is learned clipped, the rest taken again.
            block = int(which[hits[0]])
            lo = ends[block - 1] if block else 0
            hi = ends[block] if block < len(ends) else len(rest)
            if block:
                self.counts = rows[block - 1]
                self._set(fits, block - 1)
                self.pending = []
            cap = self.quantile(1.0 - threshold)
            clipped = np.where(got[lo:hi] >= threshold, np.minimum(learned[lo:hi], cap), learned[lo:hi])
            for v in clipped.tolist():
                self.learn(v)
            scores[done : done + hi] = got[:hi]
            probed[done : done + hi] = at[:hi]
            done += hi
        return scores, probed

    def _update_some(self, s: np.ndarray, threshold: float, probe: float,
                     learn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``update_probed`` with some values only scored: in order, one stretch of either at a time."""
        scores, probed = np.empty(len(s)), np.empty(len(s))
        edges = np.flatnonzero(np.diff(learn.astype(np.int8))) + 1
        for lo, hi in zip(np.r_[0, edges].tolist(), np.r_[edges, len(s)].tolist()):
            if learn[lo]:
                scores[lo:hi], probed[lo:hi] = self.update_probed(s[lo:hi], threshold, probe)
            else:
                scores[lo:hi], probed[lo:hi] = self.score_many(s[lo:hi]), self.survival(probe)
        return scores, probed

    def update(self, s: float, threshold: float) -> float:
        """Score ``s``, then learn it; beyond ``threshold`` it is learned only up to the threshold's
        quantile, so a deviation that recurs becomes normal and one fault cannot make faults normal."""
        score = self.score(s)
        self.learn(min(s, self.quantile(1.0 - threshold)) if score >= threshold else s)
        return score


def fit_due(models: Iterable[TailModel]) -> None:
    """Fit every model whose fit is due as one 2-D fit. A model learning one point at a time refits
    every ``REFIT`` points, and at one point per message those single-row fits were a sixth of a
    worker's stage 1; a fit of 100 rows costs what two of one row do. ``fit_rows`` fits rows
    independently, so this gives what each model's own fit would: it only moves the work, and a
    model it misses fits itself."""
    due = [m for m in models if m.due]
    if due:
        fit = fit_rows(np.stack([m.counts for m in due]))
        for row, model in enumerate(due):
            model._set(fit, row)
