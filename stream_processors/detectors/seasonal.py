"""Recurring patterns: find a period in a series and judge each point against its phase.

Training telemetry repeats itself: an evaluation pause every N steps, a checkpoint every M, a
memory sawtooth, a daily cycle in a serving metric. A rolling median sees each recurrence as an
outlier; the same phase one, two and three periods back predicts it.

``detect_period`` takes the highest peak of the autocorrelation (of the linearly detrended
history) after it first turns negative, the textbook reading of a correlogram, and keeps it only
if it is at least ``MIN_ACF`` and the phase model fits the recent points clearly better than a
rolling median (``phase_helps``): a random walk correlates at every lag, yet its past phases
predict it worse than its recent median, so it gets no period.

A series without a period may still trend (memory that grows until a checkpoint frees it, a
cycle too long to hold three of): ``local_line`` predicts a point from the line through its window,
and ``trend_helps`` keeps that only where it predicts the history clearly better than the median.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from rankwatch.stream_processors.detectors.scoring import median_rows, median_sorted

#: Autocorrelation of the differences at the period needed to call it one.
MIN_ACF = 0.3
#: The phase model must shrink the residuals' MAD to this fraction of the rolling median's.
MIN_GAIN = 0.7


def phase_baseline(series: np.ndarray, period: int, start: int) -> np.ndarray:
    """For each index ``j >= start`` (``start >= 3 * period``): the median of the same phase one,
    two and three periods back. One odd value in one of them (a past fault) cannot move it."""
    j = np.arange(start, len(series))
    back = np.stack([series[j - period], series[j - 2 * period], series[j - 3 * period]])
    return np.median(back, axis=0)


def phase_one(series: list[float], j: int, period: int) -> float:
    """``phase_baseline`` of index ``j`` alone, in plain Python: the middle of three is exact."""
    a, b, c = series[j - period], series[j - 2 * period], series[j - 3 * period]
    return max(min(a, b), min(max(a, b), c))


def phase_helps(history: np.ndarray, period: int, window: int) -> bool:
    """Whether the phase model predicts the history better than a rolling median does.

    Judged on the mean absolute residual over every point with three periods before it: sparse
    recurring bursts (an evaluation pause every 40 steps) are what the phase model is for, and a
    median-based spread would not see them.
    """
    start = max(3 * period, window)
    if len(history) - start < window:
        return False
    phase = np.abs(history[start:] - phase_baseline(history, period, start))
    rows = np.lib.stride_tricks.sliding_window_view(history[start - window : -1], window)
    rolling = np.abs(history[start:] - median_rows(rows))
    return float(phase.mean()) <= MIN_GAIN * float(rolling.mean())


@lru_cache(maxsize=8)
def _centred_steps(n: int) -> np.ndarray:
    t = np.arange(n, dtype=np.float64)
    return t - t.mean()


def detect_period(history: np.ndarray, window: int, max_period: int) -> int:
    """The series' period in points, or 0 when it has none worth using."""
    y = np.asarray(history, dtype=np.float64)
    n = len(y)
    longest = min(max_period, (n - window) // 3)
    if longest < 2 or not np.isfinite(y).all():
        return 0
    # The least-squares line in closed form (``np.polyfit(t, y, 1)`` costs ten times as much).
    t = _centred_steps(n)
    x = y - y.mean()
    x -= (t @ x) / (t @ t) * t
    if not np.any(x):
        return 0
    size = 1 << (2 * n - 1).bit_length()
    spectrum = np.fft.rfft(x, size)
    acf = np.fft.irfft(spectrum * np.conj(spectrum), size)[:n]
    acf = acf / acf[0] * n / (n - np.arange(n))  # unbiased: long lags are not penalised
    negative = np.flatnonzero(acf[1 : longest + 1] < 0)
    if not len(negative):
        return 0
    lags = np.arange(negative[0] + 1, longest + 1)
    if not len(lags):
        return 0
    best = int(lags[np.argmax(acf[lags])])
    # The fundamental, not a multiple of it: the first peak within 10% of the best correlation whose
    # lag divides the best one's, to a point per period (on a noisy cycle of 144 the highest peak was
    # at 284, which 142 divides exactly: the phase model then drifted 6 points over three periods),
    # taken at its own highest lag.
    high = acf >= 0.9 * acf[best]
    for lag in lags[high[lags]].tolist():
        k = round(best / lag)
        if abs(best - k * lag) <= k:
            end = lag
            while end < longest and high[end + 1]:
                end += 1
            best = lag + int(np.argmax(acf[lag : end + 1]))
            break
    if acf[best] < MIN_ACF or not phase_helps(y, best, window):
        return 0
    return best


def line_slope(rows: np.ndarray) -> np.ndarray:
    """Each row's slope per point: the gap between the medians of its halves over the distance between them."""
    n = rows.shape[1]
    half = n // 2
    return (median_rows(rows[:, n - half :]) - median_rows(rows[:, :half])) / (n - half)


def local_line(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each row of a window: the line's value one point past its end, and the row around its line.

    The slope is the gap between the medians of the window's halves over the distance between
    them: robust to a burst in either half, and in closed form (a Theil-Sen slope is O(window^2)).
    """
    n = rows.shape[1]
    slope = line_slope(rows)
    t = np.arange(n) - 0.5 * (n - 1)
    detrended = rows - slope[:, None] * t
    level = median_rows(detrended)
    return level + slope * 0.5 * (n + 1), detrended


def local_line_one(row: list[float]) -> tuple[float, list[float]]:
    """``local_line`` of one row, in plain Python: the same arithmetic, so the same floats. The row
    around its line comes sorted, as its median and MAD need it."""
    n = len(row)
    half = n // 2
    slope = (median_sorted(sorted(row[n - half :])) - median_sorted(sorted(row[:half]))) / (n - half)
    mid = 0.5 * (n - 1)
    detrended = sorted([v - slope * (i - mid) for i, v in enumerate(row)])
    return median_sorted(detrended) + slope * 0.5 * (n + 1), detrended


#: Points of history the line and the median are compared on.
TREND_EVAL = 128


def trend_helps(history: np.ndarray, window: int) -> bool:
    """Whether the local line predicts the last ``TREND_EVAL`` points clearly better (``MIN_GAIN``)
    than the rolling median does. On stationary noise the line only adds the slope's noise, and on
    a series that turns (a loss at the end of its fast fall) it overshoots: both keep the median."""
    y = np.asarray(history, dtype=np.float64)
    if len(y) < window + TREND_EVAL or window < 8:
        return False
    rows = np.lib.stride_tricks.sliding_window_view(y[-(TREND_EVAL + window) : -1], window)
    target = y[-TREND_EVAL:]
    line, _ = local_line(rows)
    rolling = np.abs(target - median_rows(rows))
    return float(np.abs(target - line).mean()) <= MIN_GAIN * float(rolling.mean())
