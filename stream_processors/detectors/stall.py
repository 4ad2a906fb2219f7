from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from rankwatch.stream_processors.detectors.base import Detector
from rankwatch.stream_processors.detectors.scoring import ratio_score

#: Per learned gap, the remembered longest gaps decay by this factor (memory of about 1,000 gaps).
_PEAK_DECAY = 0.999


class Stalled(NamedTuple):
    """One stalled rank (``rank=None``: every tracked rank, so the whole run) at ``check(now)``."""

    rank: int | None
    silent_s: float
    bound_s: float
    score: float


class Stall(Detector):
    """Heartbeats or steps that stop: silence longer than a learned or a set bound.

    As a series detector its values are durations in seconds: ``learn`` folds in the gaps between
    consecutive heartbeats (or steps), ``score`` rates a duration of silence against the bound,
    ``update`` does both (a gap that was too long is reported once it ends). The bound is
    ``bound_s`` when set; otherwise the largest of ``min_bound_s``, ``factor`` times the median of
    the last ``window`` gaps, and ``peak_factor`` times the *second* longest gap of the last
    thousand or so (slowly forgotten): a pause seen twice (an evaluation every N steps, or one that
    every rank took at once) is routine, while one rank's hang, once it ends, teaches nothing. The score is ``1 - 2**(-(silence / bound)**2)``, 0.5 (the
    threshold) at the bound. Without ``bound_s`` nothing scores until ``warmup`` gaps are seen,
    so a run that hangs before that is only caught with a set bound.

    Tracking ranks is the other half, and the one that needs a clock: ``observe(rank, ts)`` for
    each heartbeat (learning the gap since that rank's previous one), and ``check(now)`` for the
    ranks silent too long, as :class:`Stalled` records; when every tracked rank is stalled it
    returns one record with ``rank=None`` (the run stalled) instead of one per rank. A rank is
    stalled alone only if another rank stepped at least half a bound after it stopped. The caller
    supplies ``now``; the detector never reads a clock. ``forget(rank)`` stops tracking a rank
    that finished.

    Examples
    --------
    >>> d = Stall(min_bound_s=5.0)
    >>> for step in range(40):  # one step a second; rank 3 goes silent after step 19
    ...     for rank in range(4 if step < 20 else 3):
    ...         d.observe(rank, 100.0 + step)
    >>> d.bound()
    10.0
    >>> [(s.rank, s.silent_s) for s in d.check(now=140.0)]
    [(3, 21.0)]
    >>> [(s.rank, s.silent_s) for s in d.check(now=160.0)]  # now the others are silent too
    [(None, 21.0)]
    """

    name = "stall"
    severity = "critical"

    def __init__(
        self,
        *,
        bound_s: float | None = None,
        factor: float = 10.0,
        peak_factor: float = 2.0,
        min_bound_s: float = 10.0,
        window: int = 64,
        warmup: int = 10,
        threshold: float = 0.5,
        history: Sequence[float] = (),
        peaks: Sequence[float] = (0.0, 0.0),
        last_seen: Mapping[str | int, float] | None = None,
        paced: Sequence[int] = (),
        resumed: float | None = None,
    ):
        if bound_s is not None and bound_s <= 0:
            raise ValueError("bound_s must be positive")
        if factor <= 1 or peak_factor < 1 or min_bound_s < 0:
            raise ValueError("need factor > 1, peak_factor >= 1, min_bound_s >= 0")
        if window < 3 or not 1 <= warmup <= window or not 0 < threshold < 1:
            raise ValueError("need window >= 3, 1 <= warmup <= window, 0 < threshold < 1")
        self.bound_s, self.factor, self.peak_factor, self.min_bound_s = bound_s, factor, peak_factor, min_bound_s
        self.window, self.warmup, self.threshold = window, warmup, threshold
        self.history = [float(v) for v in history][-window:]
        if len(peaks) != 2:
            raise ValueError("peaks holds the two longest remembered gaps")
        self.peaks = sorted((float(p) for p in peaks), reverse=True)
        self.last_seen = {int(rank): float(ts) for rank, ts in (last_seen or {}).items()}
        self.paced = {int(rank) for rank in paced}  # ranks past their first gap
        self.resumed = resumed  # when the run last came back from a whole-run stall

    def bound(self) -> float:
        """Seconds of silence that score the threshold; ``inf`` while warming up without ``bound_s``."""
        if self.bound_s is not None:
            return self.bound_s
        if len(self.history) < self.warmup:
            return math.inf
        ordered = sorted(self.history)
        median = (ordered[(len(ordered) - 1) // 2] + ordered[len(ordered) // 2]) * 0.5
        return max(self.min_bound_s, self.factor * median, self.peak_factor * self.peaks[1])

    def score(self, values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        bound = self.bound()
        if math.isinf(bound):
            return np.zeros(len(values))
        ratio = np.where(np.isnan(values) | (values < 0), 0.0, values) / bound
        return ratio_score(ratio)

    def learn(self, values: np.ndarray) -> None:
        for gap in np.asarray(values, dtype=np.float64).tolist():
            if not math.isfinite(gap) or gap < 0:
                continue
            self.history.append(gap)
            del self.history[: -self.window]
            self.peaks = sorted([gap, *(p * _PEAK_DECAY for p in self.peaks)], reverse=True)[:2]

    def observe(self, rank: int, ts: float) -> None:
        """A heartbeat (or step) of ``rank`` at unix time ``ts``; out-of-order stamps are ignored.

        A rank's first gap is not learned: it holds the rank's start-up (loading, compiling, the
        first step), not its pace, and one slow start would otherwise raise the bound for long.
        """
        last = self.last_seen.get(rank)
        if last is not None:
            if ts <= last:
                return
            if ts - last >= self.bound() and max(self.last_seen.values()) <= ts - self.bound():
                self.resumed = float(ts)  # the first step after a whole-run stall
            if rank in self.paced:
                self.learn(np.array([ts - last]))
            self.paced.add(rank)
        self.last_seen[rank] = float(ts)

    def forget(self, rank: int) -> None:
        """Stop tracking ``rank`` (it finished or left the job)."""
        self.last_seen.pop(rank, None)
        self.paced.discard(rank)

    def check(self, now: float) -> list[Stalled]:
        """Ranks silent past the bound at ``now``, or one ``rank=None`` record when all of them are."""
        if not self.last_seen:
            return []
        ranks = sorted(self.last_seen)
        silent = np.array([max(now - self.last_seen[r], 0.0) for r in ranks])
        scores = self.score(silent)
        bound = self.bound()
        quietest = int(np.argmin(silent))  # the run is as alive as its most recent heartbeat
        if self.decide(scores).all():
            return [Stalled(None, float(silent[quietest]), bound, float(scores[quietest]))]
        # A rank is stalled alone only if another stepped well after it stopped. Ranks that stop
        # together (a DDP job waiting on one rank) reach the worker up to seconds apart, and so do
        # their first steps when the run resumes: neither is one rank's stall.
        alone = silent if self.resumed is None else np.minimum(silent, now - self.resumed)
        scores = self.score(alone)
        stalled = self.decide(scores) & (alone - silent[quietest] >= 0.5 * bound)
        return [Stalled(r, float(s), bound, float(sc)) for r, s, sc, bad in zip(ranks, alone, scores, stalled) if bad]

    def state_dict(self) -> dict[str, Any]:
        return {
            "bound_s": self.bound_s,
            "factor": self.factor,
            "peak_factor": self.peak_factor,
            "min_bound_s": self.min_bound_s,
            "window": self.window,
            "warmup": self.warmup,
            "threshold": self.threshold,
            "history": list(self.history),
            "peaks": list(self.peaks),
            "last_seen": {str(rank): ts for rank, ts in self.last_seen.items()},
            "paced": sorted(self.paced),
            "resumed": self.resumed,
        }
