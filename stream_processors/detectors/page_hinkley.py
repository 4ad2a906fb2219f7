from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rankwatch.stream_processors.detectors.calibration import THRESHOLD
from rankwatch.stream_processors.detectors.cusum import _Accumulating


def _median(values: list[float]) -> float:
    return float(np.median(values))


class PageHinkley(_Accumulating):
    """Page–Hinkley test: cumulative deviations from the mean of the current regime.

    ``m_t = sum(z_i - delta)`` and the alarm ``m_t - min(m) >= lam``, computed in the equivalent
    recursive form ``S = max(0, S + z - delta)`` for each side. Unlike ``cusum``, whose reference is
    the rolling median, the reference here is the running mean of every point since the regime
    began, forgetting old points with weight ``1 - alpha`` per point: a slow drift away from where
    the regime started accumulates instead of being followed. Residuals are in the same robust
    units as ``cusum``'s (MAD-sigma of the last ``window`` points, or the long-run sigma if larger)
    and clipped to ``clip``; the regime's mean starts at the median of its first ``warmup`` points
    and learns each later point clipped the same way, so one outlier can neither alarm nor move the
    reference far. The score is calibrated as ``cusum``'s is: before it has learned anything, the
    default threshold is reached when a sum reaches ``lam`` (defaults ``delta=1, lam=12`` chosen on the tune half of ``bench/data``).
    After an alarm a new regime starts at the estimated change point, so a change is reported once.

    Suits metrics that should hold a level: step time, throughput, grad norm, eval metrics;
    ``direction="up"`` for a loss.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> d = PageHinkley()
    >>> scores = d.update(np.r_[rng.normal(1.0, 0.01, 100), 1.0 + 0.001 * np.arange(60)])
    >>> bool(d.decide(scores[:100]).any()), bool(d.decide(scores[100:]).any())
    (False, True)
    """

    name = "page_hinkley"

    def __init__(
        self,
        *,
        window: int = 64,
        warmup: int = 20,
        delta: float = 1.0,
        lam: float = 12.0,
        alpha: float = 0.999,
        clip: float = 3.0,
        long_run: bool = True,
        threshold: float = THRESHOLD,
        min_scale: float = 1e-6,
        direction: str = "both",
        history: Sequence[float] = (),
        mean: float = 0.0,
        count: int = 0,
        pos: float = 0.0,
        neg: float = 0.0,
        pos_run: int = 0,
        neg_run: int = 0,
        noise: Sequence[float] = (0.0, 0.0, 0),
        memory: int = 1000,
        calib: Sequence[Any] = (),
    ):
        if not 0 < alpha <= 1:
            raise ValueError("need 0 < alpha <= 1")
        super().__init__(
            window=window, warmup=warmup, k=delta, h=lam, clip=clip, long_run=long_run, threshold=threshold, min_scale=min_scale,
            direction=direction, history=history, pos=pos, neg=neg, pos_run=pos_run, neg_run=neg_run, noise=noise,
            memory=memory, calib=calib,
        )
        self.delta, self.lam, self.alpha = delta, lam, alpha
        self.mean, self.count = float(mean), int(count)

    def _reference(self, median: float) -> float:
        return self.mean

    def _restart(self, keep: int) -> None:
        super()._restart(keep)
        self.count = 0
        self._begin_regime()

    def _begin_regime(self) -> None:
        """Once warm, a regime starts from the median of its points: one outlier cannot set its level."""
        if not self.count and len(self.history) >= self.warmup:
            self.mean, self.count = _median(self.history), len(self.history)

    def _after_learn(self, x: float, z: float | None, unit: float, *, restarted: bool) -> None:
        if restarted:
            return
        if z is not None and self.count:
            # Learn the clipped point, as the sums did: an outlier moves the mean by a bounded step.
            self.count += 1
            self.mean += max(1.0 - self.alpha, 1.0 / self.count) * z * unit
        self._begin_regime()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        del state["k"], state["h"]
        state.update(delta=self.delta, lam=self.lam, alpha=self.alpha, mean=self.mean, count=self.count)
        return state
