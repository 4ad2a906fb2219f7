"""Runs of far points in a detector's signed z: how rare a run is as a whole, and when one confirms
a level change. Pure; ``RobustSpike`` (and ``Blowup``, its subclass) keep the state these return,
and ``EWMA`` shares the bound.
"""

from __future__ import annotations

import math

import numpy as np

from rankwatch.stream_processors.detectors.scoring import directed
from rankwatch.stream_processors.detectors.seasonal import line_slope, local_line, phase_baseline

#: A point this many robust sigmas off, in the same direction as the ones before it, counts
#: towards a level change (``rebase``).
SHIFT_Z = 4.0
#: Pseudo-counts (far points that followed a far point, far points) of P(far | far): 1 in 10.
PAIR_PRIOR = (1.0, 10.0)
#: Far points remembered for P(far | far); beyond, both counts are halved.
PAIR_MEMORY = 200.0


def score_runs(z: np.ndarray, s: np.ndarray, far_sf: np.ndarray, pairs: list[float], *, direction: str,
               threshold: float, carried: int, alarmed: bool, min_run: int = 1) -> list[float]:
    """Score runs of far points by their joint rarity (``s`` in place); returns the new ``pairs``.

    The ``k``-th point in a row at least ``SHIFT_Z`` sigmas off on the watched side scores at least
    ``1 - P(far) * P(far | far) ** (k - 1)``: ``P(far)`` (``far_sf``) under the model that scored it,
    and ``P(far | far)`` learned on the series from the far points seen and how many followed a far
    point (``pairs``: those two counts and the estimate in use), started from 1 in 10 (far points of
    a series cluster: a busy host's slow steps come in runs). A burst, or a new level a few sigmas out
    that no single point makes rare enough, is reported within a few points, not only when a
    ``rebase`` confirms it. ``carried``: the signed run before ``z[0]``; ``alarmed``: whether it has
    raised an alarm already, in which case it raises no second one. ``min_run``: a point that ends a
    run of fewer far points (or none) stays under the threshold, whatever it scored.
    """
    far = (directed(z, direction) >= SHIFT_Z) & np.isfinite(z)
    below = np.nextafter(threshold, 0.0)
    if min_run > 1:
        np.minimum(s, below, out=s, where=~far)
    if not far.any():
        return pairs
    length, side = abs(carried), int(np.sign(carried))
    seen_far, after_far, p_next = pairs
    for i, zi in enumerate(z.tolist()):
        if not far[i]:
            length, side, alarmed = 0, 0, False
            continue
        here = 1 if zi > 0 else -1
        follows = here == side and length > 0
        length, side = (length + 1, side) if follows else (1, here)
        if length == 1:
            alarmed = False
            # What the series' past says, not this run (kept while the run lasts): a shift's own
            # points would teach it that far points always follow far points.
            p_next = (after_far + PAIR_PRIOR[0]) / (seen_far + PAIR_PRIOR[1])
        if not alarmed and length >= 2:
            s[i] = max(s[i], 1.0 - far_sf[i] * p_next ** (length - 1))
        if length < min_run:
            s[i] = min(s[i], below)
        alarmed = alarmed or s[i] >= threshold
        seen_far, after_far = seen_far + 1.0, after_far + float(follows)
        if seen_far > PAIR_MEMORY:  # old runs fade
            seen_far, after_far = seen_far / 2.0, after_far / 2.0
    return [seen_far, after_far, p_next]


def advance_shift(z: np.ndarray, run: int, rebase: int) -> tuple[int, int | None]:
    """Advance ``run``, the signed count of consecutive points at least ``SHIFT_Z`` off on one side,
    over ``z``. Returns the new count and the index of the point that confirms a level change
    (``rebase`` in a row, 0: never), where the count stops, or None."""
    far = np.abs(z) >= SHIFT_Z
    far &= np.isfinite(z)
    hits = np.flatnonzero(far)
    if not len(hits):  # the usual case: every point resets the run
        return (0 if len(z) else run), None
    if hits[0]:
        run = 0
    for i, zi in enumerate(z[hits[0] :].tolist(), int(hits[0])):
        if abs(zi) < SHIFT_Z or not math.isfinite(zi):
            run = 0
            continue
        side = 1 if zi > 0 else -1
        run = run + side if run * side > 0 else side
        if rebase and abs(run) >= rebase:
            return run, i
    return run, None


def at_new_level(
    series: np.ndarray, end: int, run: int, window: int, line: bool = False, period: int = 0
) -> np.ndarray:
    """``series[:end]``, whose last ``run`` points confirmed a level change, with the points before
    them moved to the new level: by the gap between the run's median and the median of the
    ``window`` points before it, so the rolling statistics and the recurring shape carry on.

    With ``line`` (a trending series, judged against its window's line) and a run that climbs at
    about the window's slope (within half of it), by the gap between where the run lies along that
    slope and where the window's line put its first point: a sawtooth that resets (memory freed at
    a checkpoint) then continues the same ramp, where moving it by the medians left a step of half
    a window's rise in the history, which widened every later window's spread until the step left
    it. A run that does not continue the slope (a daily cycle turning, which the line overshoots)
    moves by the medians.

    With a ``period`` (the series judged against its phase), by the gap between the medians of the
    run's and the window's residuals from their phase: the medians of a cycle's points say where
    in the cycle they lie, not where its level is, and a dip of 20 points on a daily cycle, moved
    down and then up by them, left the history's cycle broken and its period lost."""
    before, new = series[: max(end - run, 0)], series[max(end - run, 0) : end]
    if not len(before):
        return series[:end].copy()
    start = len(before) - window
    if period and start >= 3 * period:
        residual = series[start:end] - phase_baseline(series[:end], period, start)
        delta = float(np.median(residual[window:]) - np.median(residual[:window]))
        return np.r_[before + delta, new]
    rows = before[None, -window:]
    slope = float(line_slope(rows)[0]) if line and len(before) >= window and len(new) >= 4 else 0.0
    if slope and abs(float(line_slope(new[None])[0]) - slope) <= 0.5 * abs(slope):
        predicted, _ = local_line(rows)
        delta = float(np.median(new - slope * np.arange(len(new))) - predicted[0])
    else:
        delta = float(np.median(new) - np.median(rows[0]))
    return np.r_[before + delta, new]
