from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rankwatch.stream_processors.detectors.base import Detector
from rankwatch.stream_processors.detectors.calibration import THRESHOLD, TailModel, prior_counts

#: A sum scoring at least this is learned only up to this level's quantile (see ``_Accumulating``).
LEARN_CAP = 0.99
from rankwatch.stream_processors.detectors.scoring import (
    check_direction,
    learn_noise,
    long_run_sigma,
    robust_level,
    standardise,
    standardise_one,
)


class _Accumulating(Detector):
    """Two one-sided sums of standardised residuals, ``S+ = max(0, S+ + z - k)`` and
    ``S- = max(0, S- - z - k)``, alarming when the watched sum reaches ``h``.

    Subclasses say what a residual is measured from (``_reference``). Its unit is the MAD-sigma of
    the last ``window`` points or, with ``long_run``, the long-run sigma of the noise if larger
    (autocorrelated noise makes sums wander; see ``scoring.long_run_sigma``). It is clipped to
    ``clip`` units, so one outlier adds at most ``clip - k`` and cannot alarm on its own. After an
    alarm the sums restart and the history keeps only the points since the alarming sum last left
    zero (the estimated change point), so the detector re-warms on the new level instead of
    alarming again while a rolling statistic catches up.

    The score is calibrated (``calibration.TailModel``): ``1 - P(S / h >= this one)`` under the
    distribution of the watched sum learned on this series (``memory`` points). Its prior is the
    exponential law of a resting CUSUM (Siegmund's approximation) with ``P(S >= h) = 1 -
    threshold``, so before it has learned anything the threshold is reached exactly at ``S = h``.
    A sum scoring 0.99 or more is learned only up to the 0.99 quantile: a sum climbing through a
    shift is one excursion, not many independent points, and learning it would teach the model
    that the shift is normal. That cap thins the fitted far tail, so a sum below ``h`` never
    reaches the threshold: learning can widen the limit on a series whose sums wander (a
    seasonal metric under a rolling median), never narrow it below ``h`` (the minimum effect, as
    ``blowup``'s ``min_factor`` is). About 0.2-1% of clean points score 0.99 or more.
    """

    severity = "warning"

    def __init__(
        self,
        *,
        window: int,
        warmup: int,
        k: float,
        h: float,
        clip: float,
        long_run: bool,
        threshold: float,
        min_scale: float,
        direction: str,
        history: Sequence[float],
        pos: float,
        neg: float,
        pos_run: int,
        neg_run: int,
        noise: Sequence[float],
        memory: int = 1000,
        calib: Sequence[Any] = (),
    ):
        if window < 3 or not 3 <= warmup <= window:
            raise ValueError("need window >= 3 and 3 <= warmup <= window")
        if k < 0 or h <= 0 or clip <= k or min_scale < 0 or not 0 < threshold < 1:
            raise ValueError("need k >= 0, h > 0, clip > k, min_scale >= 0, 0 < threshold < 1")
        check_direction(direction)
        self.window, self.warmup, self.k, self.h, self.clip = window, warmup, k, h, clip
        self.long_run, self.threshold, self.min_scale, self.direction = bool(long_run), threshold, min_scale, direction
        self.history = [float(v) for v in history][-window:]
        self.pos, self.neg, self.pos_run, self.neg_run = float(pos), float(neg), int(pos_run), int(neg_run)
        if len(noise) != 3:
            raise ValueError("noise is [var1, var2, count]")
        self.noise = [float(noise[0]), float(noise[1]), int(noise[2])]
        if memory < 10:
            raise ValueError("need memory >= 10")
        self.memory = memory
        rate = -math.log1p(-threshold)
        counts, pending = calib if calib else (prior_counts(lambda r: np.exp(-rate * r), 50.0), [])
        self.calib = TailModel(counts, pending, memory=memory)

    def _reference(self, median: float) -> float:
        raise NotImplementedError

    def _after_learn(self, x: float, z: float | None, unit: float, *, restarted: bool) -> None:
        """Hook for state that follows each learned point (``z`` is None during warm-up)."""

    def _restart(self, keep: int) -> None:
        """Start over on the last ``keep`` points (the new level)."""
        del self.history[:-keep]
        self.pos = self.neg = 0.0
        self.pos_run = self.neg_run = 0

    def _stats(self) -> tuple[float, float]:
        """Reference level and residual unit from the current history."""
        median, unit = robust_level(self.history, self.min_scale)
        if self.long_run:
            unit = max(unit, long_run_sigma(self.noise))
        return self._reference(median), unit

    def _statistic(self, pos, neg):
        if self.direction == "up":
            return pos
        if self.direction == "down":
            return neg
        return np.maximum(pos, neg)

    def score(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        if len(self.history) < self.warmup:
            return np.zeros(len(values))
        reference, unit = self._stats()
        z = np.clip(standardise(values, reference, unit), -self.clip, self.clip)
        pos = np.maximum(0.0, self.pos + z - self.k)
        neg = np.maximum(0.0, self.neg - z - self.k)
        ratios = np.atleast_1d(self._statistic(pos, neg) / self.h)
        scores = np.array([self._score(r) for r in ratios.tolist()])
        scores[~np.isfinite(values)] = 0.0
        return scores

    def _score(self, ratio: float) -> float:
        """The learned tail probability, kept under the threshold while the sum is below ``h``:
        learning may widen the limit, never narrow it below ``h``."""
        score = self.calib.score(ratio)
        return score if ratio >= 1.0 else min(score, 1.0 - 2.0 * (1.0 - self.threshold))

    def _learn_one(self, x: float) -> float:
        """Learn one finite point; return its score (0 in warm-up)."""
        score, z, unit = 0.0, None, 0.0
        if len(self.history) >= self.warmup:
            reference, unit = self._stats()
            z = min(max(standardise_one(x, reference, unit), -self.clip), self.clip)
            self.pos = max(0.0, self.pos + z - self.k)
            self.neg = max(0.0, self.neg - z - self.k)
            self.pos_run = self.pos_run + 1 if self.pos > 0 else 0
            self.neg_run = self.neg_run + 1 if self.neg > 0 else 0
            ratio = float(self._statistic(self.pos, self.neg)) / self.h
            score = self._score(ratio)
            self.calib.learn(min(ratio, self.calib.quantile(1.0 - LEARN_CAP)) if score >= LEARN_CAP else ratio)
        self.noise = learn_noise(self.noise, self.history, x, self.clip)
        self.history.append(x)
        del self.history[: -self.window]
        alarmed = []
        if score >= self.threshold:  # restart from where the alarming sum left zero
            watched = [(stat, run) for stat, run, side in ((self.pos, self.pos_run, "up"), (self.neg, self.neg_run, "down"))
                       if self.direction in (side, "both")]
            alarmed = [max(watched)[1]]
            self._restart(max(1, alarmed[0]))
        self._after_learn(x, z, unit, restarted=bool(alarmed))
        return score

    def learn(self, values: np.ndarray) -> None:
        self.update(values)

    def update(self, values: np.ndarray) -> np.ndarray:
        # Each point's statistics are computed once and serve both its score and its learning.
        values = np.asarray(values, dtype=np.float64)
        return np.array([self._learn_one(x) if math.isfinite(x) else 0.0 for x in values.tolist()])

    def tail_models(self) -> tuple[TailModel, ...]:
        return (self.calib,)

    def state_dict(self) -> dict[str, Any]:
        return {
            "window": self.window,
            "warmup": self.warmup,
            "k": self.k,
            "h": self.h,
            "clip": self.clip,
            "long_run": self.long_run,
            "threshold": self.threshold,
            "min_scale": self.min_scale,
            "direction": self.direction,
            "history": list(self.history),
            "pos": self.pos,
            "neg": self.neg,
            "pos_run": self.pos_run,
            "neg_run": self.neg_run,
            "noise": list(self.noise),
            "memory": self.memory,
            "calib": self.calib.state(),
        }


class Cusum(_Accumulating):
    """Two-sided CUSUM of residuals from the rolling median, in robust units: level shifts.

    ``S+ = max(0, S+ + z - k)`` and ``S- = max(0, S- - z - k)``, where ``z`` is a point's deviation
    from the median of the last ``window`` points in units of their MAD-sigma (widened by
    ``sqrt((1 + rho) / (1 - rho))`` for lag-one autocorrelation ``rho`` when ``long_run``),
    clipped to ``clip``. The score is calibrated (see ``_Accumulating``): before it has learned
    anything, the default threshold is reached exactly when a sum reaches ``h``. With the defaults (``k=0.75, h=12``, chosen on the tune half of
    ``bench/data``) a three-sigma shift alarms after 5 to 12 points, depending on how well the
    window estimated the noise; one outlier never does (``spike`` owns those). After
    an alarm the detector restarts on the points since the change began and re-warms there, so a
    shift is reported once. ``direction="up"`` suits a loss, whose downward drift is the training
    working.

    Suits loss, grad norm, throughput and step time (a rank that became slower and stays slow).

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> d = Cusum()
    >>> scores = d.update(np.r_[rng.normal(1.0, 0.01, 100), rng.normal(1.03, 0.01, 30)])
    >>> bool(d.decide(scores[:100]).any()), int(np.argmax(d.decide(scores[100:])))
    (False, 16)
    """

    name = "cusum"

    def __init__(
        self,
        *,
        window: int = 64,
        warmup: int = 20,
        k: float = 0.75,
        h: float = 12.0,
        clip: float = 3.0,
        long_run: bool = True,
        threshold: float = THRESHOLD,
        min_scale: float = 1e-6,
        direction: str = "both",
        memory: int = 1000,
        history: Sequence[float] = (),
        pos: float = 0.0,
        neg: float = 0.0,
        pos_run: int = 0,
        neg_run: int = 0,
        noise: Sequence[float] = (0.0, 0.0, 0),
        calib: Sequence[Any] = (),
    ):
        super().__init__(
            window=window, warmup=warmup, k=k, h=h, clip=clip, long_run=long_run, threshold=threshold,
            min_scale=min_scale, direction=direction, history=history, pos=pos, neg=neg, pos_run=pos_run,
            neg_run=neg_run, noise=noise, memory=memory, calib=calib,
        )

    def _reference(self, median: float) -> float:
        return median
