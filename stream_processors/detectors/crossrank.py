from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from rankwatch.stream_processors.detectors.base import Detector
from rankwatch.stream_processors.detectors.scoring import (
    MAD_TO_SIGMA,
    check_direction,
    directed,
    median_rows,
    standardise,
    z_score,
)

# E|a - b| = 2 sigma / sqrt(pi) for two iid normal values: this turns |a - b| into a sigma.
_PAIR_TO_SIGMA = math.sqrt(math.pi) / 2.0
_MEAN_ABS_TO_SIGMA = math.sqrt(math.pi / 2.0)
# Beyond this many ranks one rank barely moves the median and MAD of all of them, which then serve
# as every rank's peers (two medians per step, however many ranks).
_LEAVE_ONE_OUT_MAX = 64


class CrossRank(Detector):
    """One value per rank at one step: which ranks are outliers against their peers (stragglers, divergence).

    Input is a row of ``n_ranks`` values (or a 2-D array, one row per step); the output has the
    same shape, one score per rank. Non-finite entries are missing ranks: they score 0 and are not
    learned (``nonfinite`` reports them).

    With three or more reporting ranks a rank is compared with its peers' median, in units of the
    larger of the peers' MAD-sigma at this step and the typical cross-rank sigma learned over past
    steps (so three ranks that happen to agree closely do not make the third look wild); up to 64
    ranks the peers leave the rank itself out. The median cannot be dragged by a minority of bad
    ranks, whatever their number. With exactly two ranks the median sits halfway and both deviate
    equally, so the data cannot say which one is wrong: a rank then scores only as much as it
    also deviates from its *own* history (an exponentially weighted mean and mean absolute
    deviation per rank, weight ``alpha``), and the rank that changed is named. Scores are ``2*Phi(|z| / z_scale) - 1``; the default threshold
    0.99 with ``z_scale=3`` fires at |z| > 7.7.

    With ``cusum_k > 0`` each rank's z accumulates instead, a one-sided CUSUM per rank:
    ``S = clip(S + min(z - cusum_k, cusum_h / 2), 0, 2 * cusum_h)``, scored
    ``1 - (1 - threshold)**(S / cusum_h)`` so that it fires once ``S`` reaches ``cusum_h``. A
    straggler a few sigmas slow is caught in a few steps where no single step stands out; a
    lone hiccup, however large, adds at most half the bound, and the cap lets a rank that
    recovers fall back under the bound about ``cusum_h / cusum_k`` steps later.

    ``min_rel`` floors the unit at that fraction of the peer median: with 0.02 for step time, a
    rank must be about 15% slower than its peers, on the steadiest cluster, to be called a
    straggler. ``direction="up"`` suits step time (only slow ranks are stragglers); "both" suits
    loss and grad norm (a diverging rank goes either way).

    A flagged rank is not learned (nor is the step's spread): a straggler stays firing for as long
    as it is slower than its peers, judged against its healthy past, instead of becoming its own
    new normal. With ``wait=True`` (and ``direction="down"``) the values are time spent waiting
    for the other ranks in collectives (``collective_time_s``): the rank that waits least is the
    one the others wait for, and with two ranks the evidence is its peer's wait growing, since its
    own did not change.

    With ``persist > 1`` a rank's evidence at a step is the least of its last ``persist`` steps',
    and none unless they all lie on one side, so a rank must stand out that many steps running: on
    a host that deschedules a random rank for a step now and then (several ranks on few cores),
    such a step is as slow as a straggler's.

    Scoring 1,024 ranks costs two medians of 1,024 values per step; up to 64 ranks, one median
    per rank of the others.

    Examples
    --------
    >>> rng = np.random.default_rng(0)
    >>> d = CrossRank(direction="up")
    >>> steps = rng.normal(1.0, 0.01, size=(30, 8))
    >>> steps[-1, 5] = 1.5  # rank 5 straggles on the last step
    >>> flagged = d.decide(d.update(steps))
    >>> np.argwhere(flagged).tolist()
    [[29, 5]]
    """

    name = "crossrank"
    severity = "warning"

    def __init__(
        self,
        *,
        warmup: int = 10,
        alpha: float = 0.05,
        z_scale: float = 3.0,
        threshold: float = 0.99,
        clip: float = 3.0,
        min_rel: float = 0.0,
        min_scale: float = 1e-9,
        direction: str = "both",
        cusum_k: float = 0.0,
        cusum_h: float = 10.0,
        wait: bool = False,
        persist: int = 1,
        steps: int = 0,
        spread: float = 0.0,
        rank_mean: Sequence[float] = (),
        rank_dev: Sequence[float] = (),
        rank_seen: Sequence[int] = (),
        rank_sum: Sequence[float] = (),
        rank_recent: Sequence[Sequence[float]] = (),
    ):
        if warmup < 2 or not 0 < alpha < 1 or z_scale <= 0 or clip <= 0:
            raise ValueError("need warmup >= 2, 0 < alpha < 1, z_scale > 0, clip > 0")
        if min_rel < 0 or min_scale < 0 or not 0 < threshold < 1:
            raise ValueError("need min_rel >= 0, min_scale >= 0, 0 < threshold < 1")
        if cusum_k < 0 or cusum_h <= 0 or persist < 1:
            raise ValueError("need cusum_k >= 0 (0: off), cusum_h > 0 and persist >= 1")
        check_direction(direction)
        if not len(rank_mean) == len(rank_dev) == len(rank_seen) or len(rank_sum) not in (0, len(rank_seen)):
            raise ValueError("rank_mean, rank_dev, rank_seen (and rank_sum) need one entry per rank")
        self.warmup, self.alpha, self.z_scale, self.threshold = warmup, alpha, z_scale, threshold
        self.clip, self.min_rel, self.min_scale, self.direction = clip, min_rel, min_scale, direction
        self.cusum_k, self.cusum_h = float(cusum_k), float(cusum_h)
        if wait and direction != "down":
            raise ValueError('wait=true blames the rank that waits least: use direction = "down"')
        self.wait = bool(wait)
        self.persist = int(persist)
        self.steps, self.spread = int(steps), float(spread)
        self.rank_mean = np.array(rank_mean, dtype=np.float64)
        self.rank_dev = np.array(rank_dev, dtype=np.float64)
        self.rank_seen = np.array(rank_seen, dtype=np.int64)
        self.rank_sum = np.array(rank_sum if len(rank_sum) else np.zeros(len(rank_seen)), dtype=np.float64)
        # Each rank's evidence at the last ``persist - 1`` steps (rows oldest first).
        self.rank_recent = np.array(rank_recent, dtype=np.float64).reshape(len(rank_recent), len(rank_seen))

    @staticmethod
    def _rows(values: np.ndarray) -> np.ndarray:
        values = np.asarray(values, dtype=np.float64)
        if values.ndim not in (1, 2):
            raise ValueError("CrossRank takes one row of per-rank values, or a 2-D array of rows")
        return np.atleast_2d(values)

    def _step_sigma(self, finite: np.ndarray, median: float) -> float:
        """This step's cross-rank sigma: MAD-based from three ranks on, pair-based for two."""
        if len(finite) == 2:
            return abs(finite[0] - finite[1]) * _PAIR_TO_SIGMA
        return float(median_rows(np.abs(finite - median)[None, :])[0]) / MAD_TO_SIGMA

    def _self_z(self, row: np.ndarray) -> np.ndarray:
        if len(self.rank_mean) != len(row):
            return np.zeros(len(row))
        unit = np.maximum(
            np.maximum(self.rank_dev * _MEAN_ABS_TO_SIGMA, self.min_scale), self.min_rel * np.abs(self.rank_mean)
        )
        z = standardise(row, self.rank_mean, unit)
        z[self.rank_seen < 2] = 0.0  # a rank with no history has no self-evidence
        return z

    def _magnitude_row(self, row: np.ndarray) -> np.ndarray:
        """Each rank's directed |z| against its peers (0 for missing ranks and during warm-up); with
        ``direction="both"`` it carries the sign of z, which ``_persistent`` needs."""
        magnitude = np.zeros(len(row))
        ok = np.isfinite(row)
        finite = row[ok]
        if self.steps < self.warmup or len(finite) < 2:
            return magnitude
        centre, sigma = self._peers(finite)
        unit = np.maximum(np.maximum(sigma, max(self.spread, self.min_scale)), self.min_rel * np.abs(centre))
        z = standardise(finite, centre, unit)
        found = directed(z, self.direction)
        if len(finite) == 2:
            own = self._self_z(row)[ok]
            # A wait is caused by the other rank: evidence that this one is slow is that its peer
            # now waits longer than it used to, not that this one changed.
            evidence = -own[::-1] if self.wait else own
            found = np.minimum(found, directed(evidence, self.direction))
        magnitude[ok] = found * np.sign(z) if self.direction == "both" else found
        return magnitude

    def _peers(self, finite: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each rank's peer median and the peers' MAD-sigma at this step (pair-based when two are left).

        Up to ``_LEAVE_ONE_OUT_MAX`` ranks the peers of a rank leave it out: among four ranks, a
        straggler inside the median and MAD would widen the yardstick it is measured with.
        """
        n = len(finite)
        if n == 2:  # the midpoint, and no spread of this step: each rank would be the other's yardstick
            return np.full(2, 0.5 * (finite[0] + finite[1])), np.zeros(2)
        if n > _LEAVE_ONE_OUT_MAX:
            median = float(median_rows(finite[None, :])[0])
            return np.full(n, median), np.full(n, self._step_sigma(finite, median))
        others = np.broadcast_to(finite, (n, n))[~np.eye(n, dtype=bool)].reshape(n, n - 1)
        centre = median_rows(others)
        if n == 3:
            return centre, np.abs(others[:, 0] - others[:, 1]) * _PAIR_TO_SIGMA
        return centre, median_rows(np.abs(others - centre[:, None])) / MAD_TO_SIGMA

    def _persistent(self, magnitude: np.ndarray, commit: bool) -> np.ndarray:
        """The evidence a rank has held for ``persist`` steps running, on one side: the least of its
        magnitudes at this step and the ``persist - 1`` before, or 0 where they do not all lie on the
        same side (``magnitude`` is signed with ``direction="both"``). On a busy host a rank is
        descheduled for a step at random, as slow then as a straggler; a straggler stays slow. A
        rank's minibatch loss far below its peers' at one step and far above at the next is noise; a
        diverging rank stays on one side."""
        if self.persist == 1:
            return np.abs(magnitude)
        recent = self.rank_recent
        if recent.shape != (self.persist - 1, len(magnitude)):
            recent = np.zeros((self.persist - 1, len(magnitude)))
        if commit:
            self.rank_recent = np.vstack([recent[1:], magnitude[None, :]])
        side = np.sign(magnitude)
        one_side = (np.sign(recent) == side).all(axis=0)
        return np.where(one_side, np.minimum(np.abs(magnitude), np.abs(recent).min(axis=0)), 0.0)

    def _score_row(self, row: np.ndarray, *, commit: bool = False) -> np.ndarray:
        magnitude = self._persistent(self._magnitude_row(row), commit)
        if not self.cusum_k:
            return z_score(magnitude, self.z_scale)
        before = self.rank_sum if len(self.rank_sum) == len(row) else np.zeros(len(row))
        added = np.minimum(magnitude - self.cusum_k, self.cusum_h / 2)
        total = np.where(np.isfinite(row), np.clip(before + added, 0.0, 2 * self.cusum_h), before)
        if commit:
            self.rank_sum = total
        return 1.0 - (1.0 - self.threshold) ** (total / self.cusum_h)

    def score(self, values: np.ndarray) -> np.ndarray:
        rows = self._rows(values)
        out = np.array([self._score_row(row) for row in rows]).reshape(rows.shape)
        return out if np.ndim(values) == 2 else out[0]

    def _resize(self, n: int) -> None:
        if len(self.rank_mean) != n:  # a new world size: per-rank history starts over
            self.rank_mean, self.rank_dev, self.rank_sum = np.zeros(n), np.zeros(n), np.zeros(n)
            self.rank_seen = np.zeros(n, dtype=np.int64)
            self.rank_recent = np.zeros((0, n))

    def _learn_row(self, row: np.ndarray, flagged: np.ndarray | None = None) -> None:
        # Flagged ranks are judged against the healthy past: a straggler that stays slow must not
        # become its own new normal, nor widen the typical spread it is measured with.
        flagged = np.zeros(len(row), dtype=bool) if flagged is None else flagged
        ok = np.isfinite(row)
        finite = row[ok]
        if len(finite) >= 2 and not flagged.any():
            median = float(median_rows(finite[None, :])[0])
            sigma = self._step_sigma(finite, median)
            if self.steps >= self.warmup and self.spread > 0:
                sigma = min(sigma, self.clip * self.spread)  # a bad step nudges the typical spread only
            weight = max(self.alpha, 1.0 / (self.steps + 1))
            self.spread += weight * (sigma - self.spread)
            self.steps += 1
        # Per-rank running level and deviation, Huber-clipped once a rank has history. While any rank
        # is flagged none is learned: with two ranks each one's own past is the other's evidence.
        if flagged.any():
            return
        seen = self.rank_seen[ok]
        mean, dev = self.rank_mean[ok], self.rank_dev[ok]
        resid = np.where(seen > 0, finite - mean, 0.0)
        limit = self.clip * np.maximum(dev * _MEAN_ABS_TO_SIGMA, self.min_scale)
        resid = np.where(seen >= self.warmup, np.clip(resid, -limit, limit), resid)
        weight = np.maximum(self.alpha, 1.0 / (seen + 1))
        self.rank_mean[ok] = np.where(seen > 0, mean + weight * resid, finite)
        dev_weight = np.maximum(self.alpha, 1.0 / np.maximum(seen, 1))
        self.rank_dev[ok] = np.where(seen > 0, dev + dev_weight * (np.abs(resid) - dev), 0.0)
        self.rank_seen[ok] = seen + 1

    def learn(self, values: np.ndarray) -> None:
        self.update(values)

    def update(self, values: np.ndarray) -> np.ndarray:
        rows = self._rows(values)
        out = np.empty(rows.shape)
        for i, row in enumerate(rows):
            self._resize(len(row))
            out[i] = self._score_row(row, commit=True)
            self._learn_row(row, out[i] >= self.threshold)
        return out if np.ndim(values) == 2 else out[0]

    def state_dict(self) -> dict[str, Any]:
        return {
            "warmup": self.warmup,
            "alpha": self.alpha,
            "z_scale": self.z_scale,
            "threshold": self.threshold,
            "clip": self.clip,
            "min_rel": self.min_rel,
            "min_scale": self.min_scale,
            "direction": self.direction,
            "cusum_k": self.cusum_k,
            "cusum_h": self.cusum_h,
            "wait": self.wait,
            "persist": self.persist,
            "steps": self.steps,
            "spread": self.spread,
            "rank_mean": self.rank_mean.tolist(),
            "rank_dev": self.rank_dev.tolist(),
            "rank_seen": self.rank_seen.tolist(),
            "rank_sum": self.rank_sum.tolist(),
            "rank_recent": self.rank_recent.tolist(),
        }
