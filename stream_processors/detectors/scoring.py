"""Shared arithmetic of the detectors: robust centre and scale, and the maps from statistics to [0, 1].

Two maps keep scores comparable across detectors. ``z_score`` turns a standardised deviation into
``2*Phi(|z| / z_scale) - 1``. ``ratio_score`` turns "statistic / its alarm limit" into
``1 - 2**(-r**2)``, which is 0.5 exactly at the limit, so those detectors share ``threshold = 0.5``.
"""

from __future__ import annotations

import math
from bisect import bisect_left

import numpy as np
from scipy.special import ndtr, ndtri

#: MAD of a normal sample is 0.6745 sigma; dividing by this makes a MAD comparable to a std.
MAD_TO_SIGMA = 0.6744897501960817

DIRECTIONS = ("both", "up", "down")
#: Units in the last decimal place a held level must be (three significant digits) for that unit to
#: be taken as the reading's resolution (``written_unit``).
WRITTEN_DIGITS = 100


def check_direction(direction: str) -> None:
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, not {direction!r}")


def directed(z: np.ndarray, direction: str) -> np.ndarray:
    """The deviation in the watched direction, as a non-negative magnitude (0 the other way)."""
    if direction == "up":
        return np.maximum(z, 0.0)
    if direction == "down":
        return np.maximum(-z, 0.0)
    return np.abs(z)


def median_rows(rows: np.ndarray) -> np.ndarray:
    """The median of each row: ``np.median(rows, axis=1)`` without its per-call overhead, bit for bit.

    A full sort, not ``np.partition``: numpy sorts float rows with SIMD, and a partition at two
    ranks took several times as long at the widths detectors use (docs/performance.md)."""
    n = rows.shape[1]
    part = np.sort(rows, axis=1)
    return 0.5 * (part[:, (n - 1) // 2] + part[:, n // 2])


def median_sorted(ordered: list[float]) -> float:
    """``median_rows`` of one sorted row, in plain Python (per-point numpy calls cost more)."""
    n = len(ordered)
    return (ordered[(n - 1) // 2] + ordered[n // 2]) * 0.5


def mad_sigma(ordered: list[float], median: float | None = None) -> float:
    """The MAD-sigma of sorted values around ``median`` (by default theirs), in plain Python.

    The deviations are two sorted runs, ``median - v`` below the median and ``v - median`` from it,
    so their middle is found by bisecting how many of it come from the lower run (the k-th smallest
    of two sorted lists) instead of sorting them all: the one-point spike path takes a MAD per point,
    and that sort was a sixth of a worker's stage 1. The same subtractions give the same floats as
    ``abs(v - median)``, so the result is ``median_rows``' bit for bit.
    """
    if median is None:
        median = median_sorted(ordered)
    n = len(ordered)
    split = bisect_left(ordered, median)  # lower run: ordered[split - 1 - i], i = 0, 1, ...
    k = (n - 1) // 2  # the lower middle's rank; take k + 1 deviations, i of them from the lower run
    lo, hi = max(0, k + 1 - (n - split)), min(split, k + 1)
    while lo < hi:
        i = (lo + hi) // 2
        if median - ordered[split - 1 - i] < ordered[split + k - i] - median:  # the lower run's next is smaller
            lo = i + 1
        else:
            hi = i
    j = k + 1 - lo  # deviations taken from the upper run
    lower = max(median - ordered[split - lo] if lo else -math.inf, ordered[split + j - 1] - median if j else -math.inf)
    if n % 2:
        return lower / MAD_TO_SIGMA
    upper = min(median - ordered[split - 1 - lo] if lo < split else math.inf,
                ordered[split + j] - median if split + j < n else math.inf)
    return (lower + upper) * 0.5 / MAD_TO_SIGMA


def robust_level(history: list[float], min_scale: float) -> tuple[float, float]:
    """Median and MAD-sigma of a short history, in plain Python (per-point numpy calls cost more).

    The sigma is floored at ``min_scale`` absolutely and relative to the median.
    """
    ordered = sorted(history)
    median = median_sorted(ordered)
    sigma = mad_sigma(ordered, median)
    return median, max(sigma, min_scale, min_scale * abs(median))


#: Points of memory of the noise model: autocorrelation is a slow property of a metric.
NOISE_MEMORY = 500


def learn_noise(noise: list[float], history: list[float], x: float, clip: float) -> list[float]:
    """Fold ``x`` into ``[var1, var2, count]``: exponentially weighted mean squares of the lag-1 and
    lag-2 differences, each winsorised at ``clip`` of its own sigma once warm (an outlier's two
    big differences move them a bounded step)."""
    var1, var2, count = noise
    if not history:
        return [var1, var2, count]
    count += 1
    weight = max(1.0 / NOISE_MEMORY, 1.0 / count)
    out = []
    for lag, var in ((1, var1), (2, var2)):
        if len(history) < lag:
            out.append(var)
            continue
        d = x - history[-lag]
        if count > 20 and var > 0:
            d = min(abs(d), clip * math.sqrt(var))
        out.append(var + weight * (d * d - var))
    return [out[0], out[1], count]


def long_run_sigma(noise: list[float]) -> float:
    """The long-run sigma of the noise: how far a running sum of residuals wanders per sqrt(point).

    For AR(1) noise with lag-one correlation ``rho``, ``Var(d1) = 2 sigma^2 (1 - rho)`` and
    ``Var(d2) / Var(d1) = 1 + rho``; a running sum wanders ``sqrt((1 + rho) / (1 - rho))`` times
    further than for iid noise of the same sigma. Differences barely feel a level shift or trend.
    ``rho`` is clipped to [0, 0.9]. A cumulative detector divided by this does not mistake a
    slowly wandering real metric for a shift.
    """
    var1, var2, _ = noise
    if var1 <= 0:
        return 0.0
    rho = min(max(var2 / var1 - 1.0, 0.0), 0.9)
    return math.sqrt(var1 * (1.0 + rho) / 2.0) / (1.0 - rho)


def tail_sigma(rows: np.ndarray, median: np.ndarray, quantile: float, direction: str) -> np.ndarray:
    """Sigma implied by the distance from the median to the ``quantile`` order statistic of each row
    (upper, lower, or the larger of both for "both"); equal to the std for normal data.

    A series with frequent bursts (a busy host's step time) has a wide tail, and its usual bursts
    should not each be a spike; an isolated spike does not move a high order statistic.
    """
    n = rows.shape[1]
    k = min(max(math.ceil(quantile * n) - 1, 0), n - 1)
    z = float(ndtri(quantile))
    if z <= 0:
        return np.zeros(len(rows))
    part = np.sort(rows, axis=1)  # faster than a partition at two ranks (``median_rows``)
    upper, lower = (part[:, k] - median) / z, (median - part[:, n - 1 - k]) / z
    if direction == "up":
        return upper
    if direction == "down":
        return lower
    return np.maximum(upper, lower)


def tail_sigma_sorted(ordered: list[float], median: float, quantile: float, direction: str) -> float:
    """``tail_sigma`` of one row, given sorted, in plain Python (the same order statistics)."""
    n = len(ordered)
    k = min(max(math.ceil(quantile * n) - 1, 0), n - 1)
    z = float(ndtri(quantile))
    if z <= 0:
        return 0.0
    upper, lower = (ordered[k] - median) / z, (median - ordered[n - 1 - k]) / z
    if direction == "up":
        return upper
    if direction == "down":
        return lower
    return max(upper, lower)


def smallest_step(values) -> float:
    """The smallest non-zero step between consecutive ``values`` (0: none): a reading's resolution.

    A quantised gauge (a temperature to 0.1, a counter) that mostly holds still has a MAD of 0, so
    every step of one unit looked like a thousand-sigma spike; a unit is as fine as such a reading
    can tell two values apart. On a continuous series the smallest step is tiny and changes nothing.
    """
    steps = np.abs(np.diff(np.asarray(values, dtype=np.float64)))
    steps = steps[steps > 0]
    return float(steps.min()) if len(steps) else 0.0


def written_unit(a: float, b: float) -> float:
    """One unit in the last decimal place that ``a`` (a level held) and ``b`` are written to, at most
    1; 0 where ``a`` is under ``WRITTEN_DIGITS`` such units, or either has more than 9 decimals or is
    not finite.

    A gauge that never moved has no step to learn its resolution from, and its first one-unit step
    (a temperature from 75.0 to 75.1) was an infinitely rare spike; the digits the reading is written
    with tell its unit. Float arithmetic's last bits (75.79999999999995) do not count as decimals.
    A reading of two significant digits is no gauge's resolution: 1.0 -> 2.0 doubles it.
    """
    places = []
    for v in (a, b):
        if not math.isfinite(v):
            return 0.0
        d = next((d for d in range(10) if abs(round(v, d) - v) <= 1e-6 * 10.0**-d + 1e-15 * abs(v)), None)
        if d is None:
            return 0.0
        places.append(d)
    unit = 10.0 ** -max(places)
    return unit if abs(a) >= WRITTEN_DIGITS * unit else 0.0


def trailing_windows(history: np.ndarray, window: int, first: int) -> list[np.ndarray]:
    """For each index ``i >= first`` of ``history``, the (up to) ``window`` values before it, as
    groups of equal-length rows: one 2-D array for the full windows, one row each for shorter ones."""
    n = len(history)
    short = [history[max(0, i - window) : i][None, :] for i in range(first, min(n, window))]
    full_from = max(first, window)
    if full_from < n:
        full = np.lib.stride_tricks.sliding_window_view(history[:-1], window)[full_from - window :]
        short.append(full)
    return short


def standardise(values: np.ndarray, center: float, scale: float) -> np.ndarray:
    """``(values - center) / scale`` where a zero scale or an overflow gives ±inf, never NaN."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        z = (values - center) / scale
    return np.nan_to_num(z, nan=0.0, posinf=np.inf, neginf=-np.inf)


def standardise_one(x: float, center: float, scale: float) -> float:
    """``standardise`` for one Python float, bit for bit (IEEE arithmetic is the same)."""
    if scale > 0:
        return (x - center) / scale
    return 0.0 if x == center else math.copysign(math.inf, x - center)


def directed_one(z: float, direction: str) -> float:
    """``directed`` for one Python float."""
    return max(z, 0.0) if direction == "up" else max(-z, 0.0) if direction == "down" else abs(z)


def z_score(magnitude: np.ndarray, z_scale: float) -> np.ndarray:
    """``2*Phi(m / z_scale) - 1`` for a non-negative deviation ``m``; infinite deviations score 1."""
    return 2.0 * ndtr(np.asarray(magnitude, dtype=np.float64) / z_scale) - 1.0


def ratio_score(ratio: np.ndarray) -> np.ndarray:
    """``1 - 2**(-r**2)`` for ``r = statistic / limit >= 0``: 0 at rest, 0.5 at the limit, 1 far past it."""
    r = np.minimum(np.asarray(ratio, dtype=np.float64), 1e6)  # r*r stays finite
    return -np.expm1(-np.log(2.0) * r * r)
