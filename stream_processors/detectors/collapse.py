from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rankwatch.stream_processors.detectors.base import Detector
from rankwatch.stream_processors.detectors.scoring import check_direction, ratio_score, robust_level


class Collapse(Detector):
    """A level that falls (or rises) by a large fraction within a short time: reward or entropy collapse.

    The recent level is the median of the last ``recent`` points (the scored one included); the
    earlier level is the median of the ``reference`` points before them. Their gap in the watched
    ``direction`` ("down" by default, "up" or "both") must be large on two scales at once: as a
    fraction of the earlier level (``drop``) and in standard errors of the recent median, using
    the earlier window's MAD-sigma (``min_z``). The score is the smaller of
    ``1 - 2**(-(frac / drop)**2)`` and ``1 - 2**(-(z / min_z)**2)``, so the default threshold 0.5
    means both limits are met. Medians make one bad episode irrelevant; a slow decline over many
    windows is ``trend``'s to report, not this one's. It scores 0 until
    ``reference + recent - 1`` points have been seen.

    Suits ``reward``, ``entropy`` (policy collapse), ``eval_accuracy``, ``tokens_per_s``.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> reward = np.r_[rng.normal(0.8, 0.05, 150), rng.normal(0.2, 0.05, 30)]
    >>> d = Collapse()
    >>> flagged = np.flatnonzero(d.decide(d.update(reward)))
    >>> int(flagged[0]) - 150, bool(flagged.min() >= 150)
    (4, True)
    """

    name = "collapse"
    severity = "critical"

    def __init__(
        self,
        *,
        recent: int = 10,
        reference: int = 100,
        drop: float = 0.25,
        min_z: float = 6.0,
        threshold: float = 0.5,
        min_scale: float = 1e-9,
        direction: str = "down",
        history: Sequence[float] = (),
    ):
        if recent < 1 or reference < 3:
            raise ValueError("need recent >= 1 and reference >= 3")
        if drop <= 0 or min_z <= 0 or min_scale < 0 or not 0 < threshold < 1:
            raise ValueError("need drop > 0, min_z > 0, min_scale >= 0, 0 < threshold < 1")
        check_direction(direction)
        self.recent, self.reference, self.drop, self.min_z = recent, reference, drop, min_z
        self.threshold, self.min_scale, self.direction = threshold, min_scale, direction
        self.history = [float(v) for v in history][-(self.warmup) :]

    @property
    def warmup(self) -> int:
        """Points before the first score: a full reference window and all but one recent point."""
        return self.reference + self.recent - 1

    def _score_one(self, x: float) -> float:
        if not math.isfinite(x) or len(self.history) < self.warmup:
            return 0.0
        split = len(self.history) - (self.recent - 1)
        before, unit = robust_level(self.history[:split], self.min_scale)
        recent = sorted([*self.history[split:], x])
        now = (recent[(self.recent - 1) // 2] + recent[self.recent // 2]) * 0.5
        # Standard error of a median of n normal points is about 1.2533 sigma / sqrt(n).
        stderr = unit * 1.2533 / math.sqrt(self.recent)
        scores = []
        for side, sign in (("down", -1.0), ("up", 1.0)):
            if self.direction in (side, "both"):
                gap = max(sign * (now - before), 0.0)
                frac = gap / max(abs(before), self.min_scale)
                scores.append(min(float(ratio_score(frac / self.drop)), float(ratio_score(gap / stderr / self.min_z))))
        return max(scores)

    def score(self, values: np.ndarray) -> np.ndarray:
        return np.array([self._score_one(x) for x in np.asarray(values, dtype=np.float64).tolist()])

    def learn(self, values: np.ndarray) -> None:
        values = np.asarray(values, dtype=np.float64)
        self.history.extend(values[np.isfinite(values)].tolist())
        del self.history[: -self.warmup]

    def state_dict(self) -> dict[str, Any]:
        return {
            "recent": self.recent,
            "reference": self.reference,
            "drop": self.drop,
            "min_z": self.min_z,
            "threshold": self.threshold,
            "min_scale": self.min_scale,
            "direction": self.direction,
            "history": list(self.history),
        }
