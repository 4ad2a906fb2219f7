from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rankwatch.stream_processors.detectors.base import Detector
from rankwatch.stream_processors.detectors.calibration import THRESHOLD, TailModel, half_normal_sf, prior_counts
from rankwatch.stream_processors.detectors.recurrence import MARKS, continuations, hold_recurrences
from rankwatch.stream_processors.detectors.runs import PAIR_PRIOR, SHIFT_Z, advance_shift, score_runs
from rankwatch.stream_processors.detectors.scoring import (
    MAD_TO_SIGMA,
    check_direction,
    directed,
    directed_one,
    median_rows,
    smallest_step,
    standardise,
    tail_sigma,
    trailing_windows,
    written_unit,
)
from rankwatch.stream_processors.detectors.seasonal import local_line, phase_baseline
from rankwatch.stream_processors.detectors.spike_model import PERIOD_EVERY, PRIOR_WEIGHT, SeriesModel
from rankwatch.stream_processors.detectors.spike_point import OnePoint


class RobustSpike(OnePoint, SeriesModel, Detector):
    """Spikes against a rolling median/MAD, scored by how rare such a deviation is on this series.

    A point's robust z is its distance from the median of the last ``window`` finite points in
    units of their MAD-sigma (or, with ``tail > 0.5``, the sigma implied by the ``tail`` quantile
    of the window if larger). The default is the MAD alone: routine bursts (a busy host's step
    time) are learned by the calibration below, and a unit that widens only when a window happens
    to hold enough bursts makes |z| bimodal and harder to calibrate. The median and MAD
    barely move when a few outliers enter, so one spike cannot hide the next. ``direction``
    ("both", "up" or "down") picks which deviations count.

    The score is calibrated (``calibration.TailModel``): ``1 - P(|z| >= this one)`` under the
    distribution of |z| learned on this series (``memory`` points), so 0.99 means one point in a
    hundred on clean data whatever the metric, and the default threshold 0.999999 one in a
    million. A deviation beyond the threshold is learned only up to the threshold's own quantile:
    a deviation that recurs (an evaluation pause every 50 steps) becomes normal after a few
    occurrences, while one fault does not teach the model that faults are normal.

    Recurring patterns: every 64 points the detector looks for a period of up to ``max_period``
    points in its history (``seasonal.detect_period``: autocorrelation of the differences, kept
    only if it predicts better than the rolling median). With one, a point is judged against its
    phase one, two and three periods back, so an evaluation pause every 50 steps, a checkpoint
    sawtooth or a daily cycle is expected, and a fault inside that rhythm still stands out. An
    alarm that comes at one spacing after three before it, whatever alarms lie between (a
    checkpoint every 500 steps, longer than any period looked for, or a second rhythm beside the
    first) is held under the threshold from its fourth occurrence, or from its third if it is no
    further out than the two before it (``recurrence.LIKE``).

    After ``rebase`` consecutive points more than 4 sigmas off on the same side, the level has
    changed: the history is moved to the new level (by the gap between the medians before and
    after, or, on a trending series whose new points climb at its slope, between its line and
    theirs: a sawtooth's reset), so a persistent shift is reported once, at its start, instead of
    firing until the median catches up, and the recurring shape learned before it is kept. Level
    changes confirmed while no period was known are undone once the series as it came shows a
    period: they were a cycle's turns. The point that confirms the change scores
    ``1 - P(|z| >= 4) ** rebase``: a shift of 4 to 8 sigmas that no single
    point makes rare enough is reported there, ``rebase - 1`` points after it began. ``min_scale`` floors the
    unit (absolutely and relative to the median), so a perfectly flat series scores 0 and its
    first real wiggle is reported once; so does half the reading's resolution (the smallest step
    between two values seen, in the history or before it), so a quantised gauge that flickers by
    one unit is not spiking, even after it held still for longer than the history. Non-finite
    points score 0 here (``NonFinite`` owns them) and are not learned.

    ``min_run`` (1: any point) is how many far points in a row, on the watched side, a deviation
    needs before it is news. With 2, one slow step (a loader hiccup, a descheduled process) never
    is; a drop that lasts is reported once its run as a whole is rare enough (``runs.score_runs``)
    or, at the latest, when ``rebase`` confirms the new level.

    The first ``warmup`` points score 0; from halfway through, each one's z against the points
    before it is learned all the same, so a routine deviation seen while warming up (a loader
    hiccup) is no one-in-a-million point when it recurs just after.

    Suits any noisy metric with occasional outliers: loss, grad norm, step time, throughput.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> d = RobustSpike(window=32, warmup=16)
    >>> scores = d.update(np.r_[rng.normal(1.0, 0.01, 200), 5.0])
    >>> bool(d.decide(scores)[-1]), bool(d.decide(scores[:-1]).any())
    (True, False)
    """

    name = "spike"
    severity = "warning"
    #: Whether a series without a period may be judged against its window's line (``trend_helps``).
    follows_trend = True

    def __init__(
        self,
        *,
        window: int = 64,
        warmup: int = 40,
        threshold: float = THRESHOLD,
        min_scale: float = 1e-6,
        direction: str = "both",
        tail: float = 0.5,
        memory: int = 1000,
        rebase: int = 8,
        max_period: int = 300,
        min_run: int = 1,
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
        if window < 3 or not 2 <= warmup <= window:
            raise ValueError("need window >= 3 and 2 <= warmup <= window")
        if not 0 < threshold < 1 or min_scale < 0 or not 0.5 <= tail < 1:
            raise ValueError("need 0 < threshold < 1, min_scale >= 0, 0.5 <= tail < 1")
        if memory < 10 or rebase < 0 or max_period < 0 or max_period == 1:
            raise ValueError("need memory >= 10, rebase >= 0 (0: never), max_period 0 (off) or >= 2")
        if min_run < 1:
            raise ValueError("need min_run >= 1")
        check_direction(direction)
        self.window, self.warmup, self.threshold = window, warmup, threshold
        self.min_scale, self.direction, self.tail = min_scale, direction, tail
        self.memory, self.rebase, self.max_period = memory, rebase, max_period
        self.min_run = int(min_run)
        self.history = [float(v) for v in history][-self.span :]
        self.run = int(run)  # signed count of consecutive far points on one side
        self.period = int(period)  # the detected period in points (0: none)
        self.seen = int(seen)  # finite points learned: the period is checked every PERIOD_EVERY
        # Where the last alarm episodes began and the last alarm was (positions in ``seen``), and
        # whether the present episode is a recurrence (``recurrence.hold_recurrences``).
        self.marks = [int(m) for m in marks][-MARKS:]
        self.sizes = [float(v) for v in sizes][-MARKS:]  # each episode's first |z|, for the last marks
        self.last_alarm, self.held = int(last_alarm), bool(held)
        self.trending = bool(trending)  # without a period: judged against the window's line
        self.last_z = float(last_z)  # the last learned point's z (``recurrence.continuations``)
        # Far points seen, how many followed a far point, and P(far | far) for the run in progress
        # (``runs.score_runs``).
        self.pairs = [float(v) for v in pairs]
        # The level changes confirmed since a period was last known, whose moved points are still in
        # the history: (position in ``seen`` of the first point not moved, the gap added to the
        # points before it), so that ``_undo_moves`` can see the series as it came.
        self.moves = [[int(p), float(d)] for p, d in moves]
        # The smallest non-zero step between two learned points (0: none yet): a quantised reading
        # keeps its unit when its last step has left the history (``_resolution_floor``). A state
        # written before it was kept has its history's.
        self.unit = float(unit) or smallest_step(self.history)
        # (seen, period, residuals): against the phase, the residuals of the window before the point
        # after ``seen`` learned points, for the one-point path to carry on; not state
        self._residuals: tuple[int, int, list[float]] | None = None
        counts, pending = calib if calib else (prior_counts(half_normal_sf, PRIOR_WEIGHT), [])
        self.calib = TailModel(counts, pending, memory=memory)

    @property
    def _teach_from(self) -> int:
        """History from which a warm-up point's z is taught to the tail model (``update``)."""
        return max(self.warmup // 2, 3)

    @property
    def span(self) -> int:
        """History kept: a rolling window, plus three periods of the longest period looked for."""
        return self.window + 3 * self.max_period

    def _transform(self, values: np.ndarray) -> np.ndarray:
        """The scale the statistics live on (identity here; ``Blowup`` uses logs)."""
        return values

    def _floor(self, median: np.ndarray) -> np.ndarray:
        return np.maximum(self.min_scale, self.min_scale * np.abs(median))

    def _center_scale(self, rows: np.ndarray, line: bool = False) -> tuple[np.ndarray, np.ndarray]:
        if line:
            centre, detrended = local_line(rows)
            spread = median_rows(np.abs(detrended - median_rows(detrended)[:, None])) / MAD_TO_SIGMA
            return centre, np.maximum(spread, self._floor(centre))
        median = median_rows(rows)
        mad = median_rows(np.abs(rows - median[:, None])) / MAD_TO_SIGMA
        scale = mad if self.tail <= 0.5 else np.maximum(mad, tail_sigma(rows, median, self.tail, self.direction))
        return median, np.maximum(scale, self._floor(median))

    def _adjust(self, z: np.ndarray, points: np.ndarray, center: np.ndarray) -> np.ndarray:
        """Hook on the signed z of ``points`` around their predicted ``center`` (``Blowup`` caps small jumps)."""
        return z

    def _z_stretch(self, series: np.ndarray, first: int) -> np.ndarray:
        """Signed z of ``series[first:]`` (``first >= warmup``), each against the points before it.

        With a period, a point's prediction is its phase one, two and three periods back
        (``seasonal.phase_baseline``), in units of the MAD of the last ``window`` such residuals;
        without, the median and MAD of the last ``window`` points.
        """
        p, w = self.period, self.window
        if p and first >= 3 * p + w:
            base = phase_baseline(series, p, first - w)
            residual = series[first - w :] - base
            rows = np.lib.stride_tricks.sliding_window_view(residual[:-1], w)
            middle, scale = self._center_scale(rows)
            center = base[w:] + middle
            scale = np.maximum(scale, self._floor(center))
        else:
            centers, scales = [], []
            for rows in trailing_windows(series, w, first):
                middle, unit = self._center_scale(rows, line=self.trending and rows.shape[1] == w)
                centers.append(middle)
                scales.append(unit)
            center, scale = np.concatenate(centers), np.concatenate(scales)
        points = series[first:]
        scale = np.maximum(scale, self._resolution_floor(series, first))
        return self._adjust(standardise(points, center, scale), points, center)

    def _resolution_floor(self, series: np.ndarray, first: int) -> np.ndarray:
        """For each point from ``first`` of ``series`` (the history, then points not learned yet): half
        the reading's resolution (``scoring.smallest_step``), the smallest step between two points
        learned (``unit``) or between the points before it, so a one-unit step of a quantised gauge
        is no spike, even after the gauge held still for longer than the history (a first step in a
        thousand is). Before any step, the unit its values are written to (``scoring.written_unit``)."""
        base = max(len(self.history) - 1, 0)  # the steps up to the history's last point are in ``unit``
        steps = np.abs(np.diff(series[base:]))  # steps[k]: into the point at base + k + 1
        steps[~(steps > 0)] = np.inf
        low = np.minimum.accumulate(np.r_[self.unit or np.inf, steps])[first - base - 1 : len(steps)]
        found = np.where(np.isfinite(low), low, 0.0)
        # A reading that never moved: its first step, in the unit its values are written to.
        for i in np.flatnonzero((found == 0) & np.isfinite(steps[first - base - 1 :])).tolist():
            found[i] = written_unit(series[first + i - 1], series[first + i])
        return 0.5 * found

    def _learn_unit(self, points: np.ndarray) -> None:
        """Carry ``unit`` over the steps between consecutive learned ``points``."""
        smallest = smallest_step(points)
        if smallest:
            self.unit = min(self.unit, smallest) if self.unit else smallest

    def score(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        scores = np.zeros(len(values))
        if len(self.history) < self.warmup:
            return scores
        history = np.asarray(self.history)
        finite = np.flatnonzero(np.isfinite(values))
        z = [self._z_stretch(np.concatenate((history, self._transform(values[i : i + 1]))), len(history))
             for i in finite.tolist()]
        if z:
            scores[finite] = self.calib.score_many(directed(np.concatenate(z), self.direction))
        return scores

    def learn(self, values: np.ndarray) -> None:
        self.update(values)

    def update(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        if len(values) == 1:
            score = self._update_one(float(values[0]))
            if score is not None:
                return np.array([score])
        # Within a stretch (no level change, no period check) every point's z is known up front,
        # since the history grows by the finite points whatever their scores: one numpy pass per
        # stretch for the z, one for the tail model (``TailModel.update_many``), and the shift
        # test goes point by point only from the first point 4 sigmas off.
        finite = np.flatnonzero(np.isfinite(values))
        points = self._transform(values[finite])
        scores = np.zeros(len(values))
        done = 0
        while done < len(points):
            # A stretch ends where the period is checked again (every PERIOD_EVERY learned points).
            stop = min(len(points), done + PERIOD_EVERY - self.seen % PERIOD_EVERY)
            series = np.concatenate((self.history, points[done:stop]))  # np.r_ converted the history twice
            start = len(self.history)
            first = max(start, self.warmup)
            z = np.full(stop - done, np.nan)
            if first < len(series):
                z[first - start :] = self._z_stretch(series, first)
            # Warm-up points (z NaN) score 0; from ``_teach_from`` on, their z teaches the tail model.
            warm = max(first - start, 0)
            teach = max(start, self._teach_from)
            if teach < min(first, len(series)):
                self.calib.update_probed(
                    directed(self._z_stretch(series[:first], teach), self.direction), self.threshold, SHIFT_Z)
            # A far point that continues one is the same episode: held, and not learned again (a
            # sawtooth's reset, 8 far points to the rebase, taught the tail model 4-sigma points
            # by the dozen and put its one-in-a-million point at 20-400 sigmas).
            judged, again = continuations(z[warm:], self.last_z, SHIFT_Z)
            carried = self.run
            self.run, shift = advance_shift(z[warm:], self.run, self.rebase)
            upto = len(z) if shift is None else warm + shift + 1
            # The tail model scores each point, then learns it (beyond the threshold only up to
            # the threshold's quantile): a deviation that recurs becomes normal, one fault does not.
            s, far_sf = self.calib.update_probed(
                directed(judged[: upto - warm], self.direction), self.threshold, SHIFT_Z, ~again[: upto - warm]
            )
            # A run that has raised an alarm already raises no second one.
            alarmed = bool(carried and self.marks and self.last_alarm >= self.seen + warm - abs(carried))
            self.pairs = score_runs(z[warm:upto], s, far_sf, self.pairs, direction=self.direction,
                                    threshold=self.threshold, carried=carried, alarmed=alarmed,
                                    min_run=self.min_run)
            rebased = None
            if shift is not None:
                # A level change is confirmed: ``rebase`` points in a row, each as rare as a
                # 4-sigma one, is far rarer than the threshold on clean data. It is news only on
                # the watched side (an upward detector's series falling to a new level, a sawtooth's
                # reset, is none), and only if no point of the run was (a large shift is reported
                # at its first point).
                begun = self.seen + upto - 1 - (self.rebase - 1)
                if directed_one(float(self.run), self.direction) > 0 and not (
                    s[max(len(s) - self.rebase, 0) :] >= self.threshold
                ).any() and not (self.marks and self.last_alarm >= begun):
                    s[-1] = max(s[-1], 1.0 - self.calib.survival(SHIFT_Z) ** self.rebase)
                rebased = upto - 1
            self.marks, self.sizes, self.last_alarm, self.held = hold_recurrences(
                s, self.seen + warm, self.threshold, self.rebase, self.marks, self.last_alarm, self.held,
                judged[: upto - warm], self.sizes,
            )
            last = z[upto - 1] if upto > warm else 0.0
            self.last_z = float(last) if rebased is None and math.isfinite(last) else 0.0
            scores[finite[done + warm : done + upto]] = s
            self._learn_unit(series[max(start - 1, 0) : start + (stop - done if rebased is None else rebased + 1)])
            if rebased is None:
                self.history = series[-self.span :].tolist()
                self.seen += stop - done
                done = stop
            else:
                # The level changed. The run's points come from the series: those before this call
                # are in the history (a run that began in an earlier batch moves as one that began here).
                upto = done + rebased + 1
                moved = self._at_new_level(series, start + upto - done, start)
                self.history = moved[-self.span :].tolist()
                self.seen += upto - done
                self.run, done = 0, upto
            self._look_for_period()
        return scores

    def tail_models(self) -> tuple[TailModel, ...]:
        return (self.calib,)

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "warmup": self.warmup,
            "threshold": self.threshold,
            "min_scale": self.min_scale,
            "direction": self.direction,
            "tail": self.tail,
            "memory": self.memory,
            "rebase": self.rebase,
            "max_period": self.max_period,
            "min_run": self.min_run,
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
