"""Step-window rollups as sufficient statistics (count, mean, M2, min, max, a quantile sketch), never
unbounded lists of points.

Windows are tumbling in training steps, ``[k*W, (k+1)*W)``: steps, not seconds, are what people
compare across ranks and runs. A window closes when a later window's first point arrives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from rankwatch.contract import Rollup
from rankwatch.sketch import MAX_CENTROIDS, Sketch

_FLOATS = ("mean", "m2", "min", "max", "last")  # the fields that may be infinite or NaN


@dataclass(slots=True)  # every metric's window takes a point per message: attribute access is most of that
class Window:
    index: int
    count: int = 0
    nonfinite: int = 0
    mean: float = 0.0
    m2: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    last: float = math.nan
    first_step: int | None = None  # the steps the window saw
    last_step: int | None = None
    # Finite values, for p50/p95/p99: a plain list up to MAX_CENTROIDS of them (a t-digest of that many
    # is exact, and a list is many times cheaper to add one point to and to write as state every few
    # seconds: a 50-step window of one point a step never needs more), a t-digest beyond.
    points: list[float] = field(default_factory=list)
    sketch: Sketch | None = None

    def add(self, values: np.ndarray, steps: np.ndarray | None = None) -> None:
        """Merge a block of values (Chan et al.'s parallel update: one pass, numerically stable)."""
        if len(values) == 1:
            return self.add_one(None if steps is None or not len(steps) else int(steps[0]), float(values[0]))
        if steps is not None and len(steps):
            first, last = int(steps[0]), int(steps[-1])
            self.first_step = first if self.first_step is None else min(self.first_step, first)
            self.last_step = last if self.last_step is None else max(self.last_step, last)
        if not len(values):
            return
        self.last = float(values[-1])
        # The ufuncs' reductions straight, not the methods' Python wrappers: a window gets one block
        # per metric per message. A finite sum means every value is finite (the usual case), and it
        # is the sum ``mean`` would take.
        b_sum = float(np.add.reduce(values))
        finite = values
        if not math.isfinite(b_sum):
            finite = values[np.isfinite(values)]
            self.nonfinite += len(values) - len(finite)
            b_sum = float(np.add.reduce(finite))
        n = len(finite)
        if not n:
            return
        b_mean = b_sum / n
        deviations = finite - b_mean
        b_m2 = float(np.add.reduce(deviations * deviations))
        total = self.count + n
        delta = b_mean - self.mean
        self.mean += delta * n / total
        self.m2 += b_m2 + delta * delta * self.count * n / total
        self.count = total
        if self.sketch is None and len(self.points) + n <= MAX_CENTROIDS:
            self.points += finite.tolist()
        else:
            self.quantile_sketch().add(finite)
        self.min = min(self.min, float(np.minimum.reduce(finite)))
        self.max = max(self.max, float(np.maximum.reduce(finite)))

    def add_one(self, step: int | None, x: float) -> None:
        """``add`` of one point, without arrays: Welford's update. One point per message is common (one
        step per batch), and numpy's fixed cost per call would dominate it."""
        if step is not None:
            if self.first_step is None or step < self.first_step:
                self.first_step = step
            if self.last_step is None or step > self.last_step:
                self.last_step = step
        self.last = x
        if not math.isfinite(x):
            self.nonfinite += 1
            return
        self.count += 1
        if self.sketch is not None:
            self.sketch.add_one(x)
        elif len(self.points) < MAX_CENTROIDS:
            self.points.append(x)
        else:
            self.quantile_sketch().add_one(x)
        delta = x - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (x - self.mean)
        if x < self.min:
            self.min = x
        if x > self.max:
            self.max = x

    def quantile_sketch(self) -> Sketch:
        """The window's finite values as a sketch; from here on they are kept in it."""
        if self.sketch is None:
            self.sketch, self.points = Sketch.of(self.points), []
        return self.sketch

    def to_rollup(self, *, run: str, rank: int, metric: str, width: int, now: float,
                  world_size: int | None = None) -> Rollup:
        std = math.sqrt(self.m2 / (self.count - 1)) if self.count > 1 else 0.0
        empty = self.count == 0
        sketch = self.quantile_sketch()
        p50, p95, p99 = sketch.quantiles()
        return Rollup(
            run=run, rank=rank, metric=metric,
            start_step=self.index * width, end_step=(self.index + 1) * width,
            count=self.count, nonfinite=self.nonfinite,
            mean=math.nan if empty else self.mean, std=std,
            min=math.nan if empty else self.min, max=math.nan if empty else self.max,
            last=self.last, ts=now, first_step=self.first_step, last_step=self.last_step, world_size=world_size,
            p50=p50, p95=p95, p99=p99, sketch=None if empty else sketch.to_wire(),
        )

    def to_dict(self) -> dict:
        # Infinities and NaN as strings: the state is JSON-able (strict JSON has neither).
        d = {"index": self.index, "count": self.count, "nonfinite": self.nonfinite,
             "first_step": self.first_step, "last_step": self.last_step}
        for k in _FLOATS:
            v = getattr(self, k)
            d[k] = v if math.isfinite(v) else repr(v)
        if self.sketch is None:
            d["points"] = self.points
        else:
            d["sketch"] = self.sketch.to_wire()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Window:
        # State written before windows kept their points has a sketch, and state written before
        # windows kept either has neither: its quantiles cover the points after.
        sketch = Sketch.from_wire(d["sketch"]) if d.get("sketch") is not None else None
        fields = {k: float(v) if isinstance(v, str) else v for k, v in d.items() if k not in ("sketch", "points")}
        return cls(**fields, points=[float(v) for v in d.get("points", ())], sketch=sketch)


def roll(window: Window | None, steps: np.ndarray, values: np.ndarray, width: int) -> tuple[Window | None, list[Window]]:
    """Add points to the open window; return the new open window and the windows that closed."""
    closed: list[Window] = []
    if not len(steps):
        return window, closed
    if len(steps) == 1:
        return roll_one(window, int(steps[0]), float(values[0]), width)
    index = steps // width
    if index[0] == index[-1]:
        bounds = [(0, len(steps))]  # the usual case, without numpy's per-call overhead on tiny arrays
    else:
        # Points arrive in step order within a rank; split where the window index changes.
        cuts = (np.flatnonzero(np.diff(index)) + 1).tolist()
        bounds = list(zip([0, *cuts], [*cuts, len(steps)]))
    for lo, hi in bounds:
        k = int(index[lo])
        if window is not None and k != window.index:
            if k < window.index:
                continue  # a late point of a window already closed: its rollup is out
            closed.append(window)
            window = None
        if window is None:
            window = Window(index=k)
        window.add(values[lo:hi], steps[lo:hi])
    return window, closed


def roll_one(window: Window | None, step: int, x: float, width: int) -> tuple[Window | None, list[Window]]:
    """``roll`` of one point as plain numbers: one step per message is the usual case, and numpy's
    fixed cost per call would be most of its work."""
    k = step // width
    if window is not None and k != window.index:
        if k < window.index:
            return window, []  # a late point of a window already closed: its rollup is out
        window, closed = Window(index=k), [window]
    else:
        closed = []
        if window is None:
            window = Window(index=k)
    window.add_one(step, x)
    return window, closed
