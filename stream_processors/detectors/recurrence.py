"""Alarms that are structure, not news: a deviation that continues the one before it, and an alarm
episode that recurs at a fixed spacing. Shared by ``spike`` (and ``blowup``) and ``ewma``.

- **Continuations.** A point far off (``far`` sigmas) right after a point far off the same way, and not
  ``far`` sigmas further out, is held to ``far``: a level that moved, or a sawtooth that just reset,
  is news at its first point, not at each point until the detector re-baselines. A 50x step after a
  routine 5x burst is further out, so it is news.
- **Recurrences.** A checkpoint every 500 steps, an evaluation pass every 80, a sawtooth's reset: an
  alarm episode (alarms each within ``gap`` points of the last) that begins ``d``, ``2 d`` and
  ``3 d`` after three earlier episodes (within 5%; other episodes may fall between) is the same
  event again, and all of it is held under the threshold. A fault is rarely so punctual, and its
  first three occurrences are reported. Where the episodes' sizes are known (``spike``), one that
  begins ``d`` and ``2 d`` after two earlier ones and is no further out than ``LIKE`` times the
  larger of them is held already: the third of a checkpoint's pauses, not a stall 60 times a step
  at the spacing of two evaluation bursts. The series' start counts as an episode of unknown size,
  since a trainer saves and evaluates every N steps counted from step 0: a second episode that
  begins twice as far from the start as the first, and is no further out than ``LIKE`` times it,
  is held too.
"""

from __future__ import annotations

import math

import numpy as np

#: Starts of alarm episodes kept. The rhythm is looked for among all of them, not only the last
#: few: on the tuning part a checkpoint's alarms every 251 steps were never held, because
#: evaluation alarms fell between them.
MARKS = 8
#: Episodes at one spacing, the present one included, that make a recurrence. With three, an eval
#: burst's two false alarms 56 steps apart held a 60x stall that came 56 steps later.
REPEATS = 4
#: How much further out than the larger of two earlier episodes a third at their spacing may be
#: and still be held (``recurs``), and how close to that spacing it must begin: a checkpoint's or an
#: evaluation's rhythm is exact to a step, while within 5% a fault 1,301 steps after one checkpoint
#: alarm and 2,651 after another (2 x 1,301 = 2,602) was held.
LIKE, LIKE_WITHIN = 1.5, 0.01


def recurs(marks: list[int], pos: int, sizes: list[float] = (), size: float = math.inf) -> bool:
    """Whether an episode beginning at ``pos`` is the ``REPEATS``-th of a rhythm: past episodes
    began ``d``, ``2 d`` and ``3 d`` before it (each within 5% of ``d``), whatever other episodes
    lie between them. Or the third, given the episodes' ``sizes`` (their first alarm's |z|, aligned
    with the last marks; one not known holds nothing) and this one's: two began ``d`` and ``2 d``
    before it (within ``LIKE_WITHIN``), position 0 counting as one of unknown size, and it is no
    further out than ``LIKE`` times the larger of them."""
    past = np.asarray(marks, dtype=np.float64)
    sizes = list(sizes)[-len(marks) :] if marks else []
    known = np.r_[np.full(len(marks) - len(sizes), np.nan), sizes]
    for j, spacing in enumerate((pos - past).tolist()):
        if spacing <= 0:
            continue
        tol = max(1.0, 0.05 * spacing)
        near = [np.abs(pos - k * spacing - past) <= tol for k in range(2, REPEATS)]
        if all(n.any() for n in near):
            return True
        within = max(1.0, LIKE_WITHIN * spacing)
        like = np.abs(pos - 2 * spacing - past) <= within
        if like.any() and size <= LIKE * float(np.max(np.r_[known[j], known[like]])):
            return True
        if abs(pos - 2 * spacing) <= within and size <= LIKE * known[j]:
            return True
    return False


def continuations(z: np.ndarray, last_z: float, far: float) -> tuple[np.ndarray, np.ndarray]:
    """``z`` with each continuing far point held to ``far``, and which points those are (``last_z``:
    the z of the point before ``z[0]``)."""
    before = np.r_[last_z, z[:-1]]
    with np.errstate(invalid="ignore"):
        again = (np.abs(z) >= far) & (np.abs(before) >= far) & (np.sign(z) == np.sign(before))
        again &= np.abs(z) < np.abs(before) + far
    return np.where(again, np.clip(z, -far, far), z), again


def hold_recurrences(
    s: np.ndarray, first: int, threshold: float, gap: int, marks: list[int], last_alarm: int, held: bool,
    z: np.ndarray | None = None, sizes: list[float] = (),
) -> tuple[list[int], list[float], int, bool]:
    """Hold recurring alarms of ``s`` (scores of the points at positions ``first``, ``first + 1``, ...)
    just under ``threshold``, in place; returns the new ``marks``, their ``sizes`` (given ``z``, the
    points' z: else none), ``last_alarm`` and ``held``."""
    hold = 1.0 - 2.0 * (1.0 - threshold)
    sizes = list(sizes) if z is not None else []
    for i in np.flatnonzero(s >= threshold).tolist():
        pos = first + i
        if not marks or pos - last_alarm > max(gap, 1):
            size = abs(float(z[i])) if z is not None else math.inf
            held = recurs(marks, pos, sizes, size)
            marks = (marks + [pos])[-MARKS:]
            if z is not None:
                sizes = (sizes + [size])[-MARKS:]
        if held:
            s[i] = min(s[i], hold)
        last_alarm = pos
    return marks, sizes, last_alarm, held
