"""``RobustSpike``'s one-point path: ``update`` of a single point in plain Python.

At one step per message a detector sees its points one at a time, and numpy's fixed cost per call
on a one-element array was nearly all of its time (issue 16). For the usual point (less than 4
sigmas off, or still warming up, and under the threshold) this path does the arithmetic of the
array path (``RobustSpike._z_stretch`` and ``update``) on Python floats, against the rolling
median, the window's line or the series' phase alike; anything else goes to the array path.
``tests/test_detectors_batch.py`` holds the two to the same scores and state.

A mixin of ``RobustSpike``: it reads and changes that class's parameters and learned state, and two
caches of its own that are not state, made in ``RobustSpike.__init__`` and forgotten by the array path.
"""

from __future__ import annotations

import math

from rankwatch.stream_processors.detectors.runs import SHIFT_Z
from rankwatch.stream_processors.detectors.scoring import (
    directed_one,
    mad_sigma,
    median_sorted,
    standardise_one,
    tail_sigma_sorted,
    written_unit,
)
from rankwatch.stream_processors.detectors.seasonal import local_line_one, phase_one


class OnePoint:
    """The one-point path; ``RobustSpike.update`` tries it first for a single point."""

    # ``RobustSpike``'s hooks ``_transform``, ``_floor`` and ``_adjust`` for one point, in plain
    # Python: numpy's fixed cost per call on a one-element array was a fifth of this path.
    def _transform_one(self, value: float) -> float:
        return value

    def _floor_one(self, median: float) -> float:
        return max(self.min_scale, self.min_scale * abs(median))

    def _adjust_one(self, z: float, point: float, center: float) -> float:
        return z

    def _center_scale_one(self, rows: list[float]) -> tuple[float, float]:
        """``_center_scale`` of one row (no line), in plain Python: the same order statistics."""
        ordered = sorted(rows)
        median = median_sorted(ordered)
        scale = mad_sigma(ordered, median)
        if self.tail > 0.5:
            scale = max(scale, tail_sigma_sorted(ordered, median, self.tail, self.direction))
        return median, max(scale, self._floor_one(median))

    def _update_one(self, value: float) -> float | None:
        """``update`` of one usual point (see above); None, having changed nothing, for any other,
        which the array path then takes."""
        if not math.isfinite(value):
            return 0.0  # as there: scored 0 and not learned
        history = self.history
        # Warming up, a point is learned, not judged; from ``_teach_from`` on its z teaches the tail model.
        teaching = len(history) < self.warmup
        if teaching and len(history) < self._teach_from:
            return self._learn_one(self._transform_one(value), 0.0, 0.0)
        x = self._transform_one(value)
        p, w = self.period, self.window
        phased = None
        if p and len(history) >= 3 * p + w:  # as ``_z_stretch``: against the phase, in the residuals' unit
            first = len(history)
            here = phase_one(history, first, p)
            kept = self._residuals
            if kept is not None and kept[:2] == (self.seen, p):
                residuals = kept[2]
            else:
                residuals = [history[j] - phase_one(history, j, p) for j in range(first - w, first)]
            middle, scale = self._center_scale_one(residuals)
            center = here + middle
            scale = max(scale, self._floor_one(center))
            phased = residuals, here
        else:
            rows = history[-w:]
            if self.trending and len(rows) == w:
                center, ordered = local_line_one(rows)
                scale = max(mad_sigma(ordered), self._floor_one(center))
            else:
                center, scale = self._center_scale_one(rows)
        scale = max(scale, self._resolution_floor_one(history, x))
        z = self._adjust_one(standardise_one(x, center, scale), x, center)
        if not (teaching or abs(z) < SHIFT_Z):
            return None
        deviation = directed_one(z, self.direction)
        score = 1.0 - self.calib.survival(deviation)
        if score >= self.threshold:
            return None  # learned clipped to the threshold's quantile: the general path
        if teaching:
            self.calib.learn(deviation)
            return self._learn_one(x, 0.0, 0.0)
        # What the general path does to a quiet point: no continuation, no run, no alarm.
        self.calib.learn(deviation)
        self.run = 0
        if phased is not None:  # the next point's window of residuals: this one's, moved on by x's
            self._residuals = (self.seen + 1, p, phased[0][1:] + [x - phased[1]])
        return self._learn_one(x, z, score)

    def _learn_one(self, x: float, z: float, score: float) -> float:
        """The one-point path's end: ``x`` joins the history with ``z`` (0 while warming up); returns ``score``."""
        self.last_z = z
        if self.history:
            step = abs(x - self.history[-1])
            if step > 0 and not 0 < self.unit <= step:
                self.unit = step
        self.history.append(x)
        del self.history[: -self.span]
        self.seen += 1
        self._look_for_period()
        return score

    def _resolution_floor_one(self, history: list[float], x: float) -> float:
        """``_resolution_floor`` of ``x`` after ``history``, every point of which is learned: half ``unit``."""
        found = self.unit
        if not found and x != history[-1]:
            found = written_unit(history[-1], x)
        return 0.5 * found
