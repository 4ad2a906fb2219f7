"""``RobustSpike``'s model of a series: against what a point is judged, and where its history lies.

Every ``PERIOD_EVERY`` learned points the model is chosen again: the series' phase if it has a
period (``seasonal.detect_period``), else the line through the window where that predicts clearly
better (``seasonal.trend_helps``), else the rolling median. When a run of far points confirms a level
change, the history is moved to the new level (``runs.at_new_level``). Moves made while no period is
known are kept, and undone when the series as it came shows a period: they were the turns of a
cycle judged against its line.

A mixin of ``RobustSpike``, as ``spike_point.OnePoint`` is: it reads and changes that class's
parameters and learned state.
"""

from __future__ import annotations

import numpy as np

from rankwatch.stream_processors.detectors.calibration import TailModel, half_normal_sf, prior_counts
from rankwatch.stream_processors.detectors.runs import at_new_level
from rankwatch.stream_processors.detectors.seasonal import detect_period, trend_helps

#: Pseudo-points of the half-normal prior a fresh tail model starts from.
PRIOR_WEIGHT = 50.0
#: Learned points between two looks for a period.
PERIOD_EVERY = 64


class SeriesModel:
    """The model's choice and the history's moves; ``RobustSpike`` calls them from ``update``."""

    def _look_for_period(self) -> None:
        """Every ``PERIOD_EVERY`` learned points: a period, else (where allowed) whether a line fits."""
        if self.seen % PERIOD_EVERY or not (self.max_period or self.follows_trend):
            return
        history = np.asarray(self.history)
        period = 0
        if self.moves:  # kept only while a period is looked for and none is known
            period, history = self._undo_moves(history)
        if self.max_period and not period:
            period = detect_period(history, self.window, self.max_period)
        if period or not self.max_period:
            self.moves = []
        trending = self.follows_trend and not period and trend_helps(history, self.window)
        # The tail model carries over to the new model: starting it afresh from the half-normal
        # prior made every routine burst the new model does not predict (a loader hiccup every 23
        # steps beside an evaluation period of 25) a one-in-a-million point again for its next
        # few occurrences. Leaving a line is the exception: its tail is mostly the line's own
        # overshoot where the series turns (a daily cycle before its period is seen: one in a
        # million at 11 sigmas), which the next model does not make, so it starts afresh.
        if self.trending and not trending:
            self.calib = TailModel(prior_counts(half_normal_sf, PRIOR_WEIGHT), memory=self.memory)
        self.period, self.trending = period, trending

    def _at_new_level(self, series: np.ndarray, end: int, start: int) -> np.ndarray:
        """``series[:end]`` (the history is ``series[:start]``), whose last ``|run|`` points confirmed a
        level change, moved to the new level; the move is kept while no period is known."""
        moved = at_new_level(series, end, abs(self.run), self.window, line=self.trending, period=self.period)
        cut = end - abs(self.run)  # the run's first point: those before it moved
        if cut > 0 and self.max_period and not self.period:
            self.moves.append([self.seen - start + cut, float(moved[cut - 1] - series[cut - 1])])
        return moved

    def _undo_moves(self, history: np.ndarray) -> tuple[int, np.ndarray]:
        """The period of the series as it came (0: none), and the history to keep.

        Level changes confirmed on a cycle the detector has not found yet are mostly the line's
        overshoot where the cycle turns: a daily cycle of 144 points, judged against its window's
        line, had its history moved by up to twice its amplitude, which hid the very period that
        explains the turns; on a noisier cycle it showed a wrong one (140 for 144). If the series as
        it came has a period, the moves are undone."""
        first = self.seen - len(history)  # the position of ``history[0]``
        self.moves = [m for m in self.moves if m[0] > first]
        raw = history.copy()
        for position, gap in self.moves:
            raw[: position - first] -= gap
        period = detect_period(raw, self.window, self.max_period)
        if not period:
            return 0, history
        self.moves, self._residuals = [], None
        self.history = raw.tolist()
        return period, raw
