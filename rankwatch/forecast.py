"""Look ahead on a metric's history: fit its trend with a 95% prediction band and say what comes next.

Pure numpy/scipy over (steps, values). Values are turned into "goodness" (negated when smaller is
better) and fitted with a saturating curve, ``g = c - a·exp(-b·(step - s0))`` (a ≥ 0: rising to ``c``);
a straight line stands in when that fit fails. Three verdicts:

- **plateau**: the curve has (or will have) closed all but ``tol`` (5%) of its total rise by step N:
  "plateau expected around step N" (or "plateau reached around step N" when N is behind us).
- **collapse**: the newest point (up to three) fell below the one-sided 99.5% prediction bound of the
  trend fitted on the points before them, or the metric lost half of what it had gained, or the last
  few points fall significantly (one-sided slope test, p < 0.05) and sit well below the best so far:
  "reward falling, collapse risk".
- **improving**: still rising with no plateau within ten times the observed span.

A metric with no known direction (``direction=None``: grad norm, KL…) is fitted in the direction it moved,
and can only plateau or keep moving; "collapse" needs to know which way is worse.

>>> steps = np.arange(0, 400, 20)
>>> acc = 0.9 - 0.7 * np.exp(-steps / 80) + np.random.default_rng(0).normal(0, 0.005, steps.size)
>>> f = forecast("accuracy", steps, acc)  # true plateau: 80 · ln 20 = 240
>>> f["kind"], 220 <= f["plateau_step"] <= 260
('plateau', True)
>>> forecast("accuracy", steps[:6], acc[:6])["verdict"][:40]  # from the first 100 steps
'accuracy: plateau expected around step 2'
>>> f = forecast("reward", steps, np.r_[acc[:15], acc[14] - 0.1 * np.arange(1, 6)], direction="higher")
>>> f["kind"], f["verdict"].startswith("reward falling, collapse risk")
('collapse', True)
"""

from __future__ import annotations

import math
import warnings

import numpy as np
from scipy import optimize, stats

MIN_POINTS = 5
TOL = 0.05  # a plateau: all but this fraction of the curve's total rise is done
HIGHER = ("acc", "correct", "reward", "score", "return", "f1", "bleu", "rouge", "pass", "win", "exact", "composite")
LOWER = ("loss", "error", "err", "perplexity", "ppl", "nonfinite")


def direction_of(metric: str) -> str | None:
    """"higher" or "lower" when the name says which is better, else None.

    >>> direction_of("eval_loss"), direction_of("correct"), direction_of("grad_norm")
    ('lower', 'higher', None)
    """
    name = metric.lower()
    if any(w in name for w in LOWER):
        return "lower"
    if any(w in name for w in HIGHER):
        return "higher"
    return None


def _saturating(x, c, a, b):
    return c - a * np.exp(-b * x)


def _fit(x: np.ndarray, g: np.ndarray, q: float = 0.975):
    """(predict(x) -> (mean, half-width of the prediction band), params or None for the line); ``q``: the
    band's upper quantile (0.975: a two-sided 95% band)."""
    span = max(float(x[-1] - x[0]), 1.0)
    u = (x - x[0]) / span  # scaled so b is about 1-10 whatever the step count
    dof = max(len(x) - 3, 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p, cov = optimize.curve_fit(_saturating, u, g, p0=(g.max(), max(g.max() - g[0], 1e-9), 3.0),
                                        bounds=([-np.inf, 0.0, 1e-3], [np.inf, np.inf, 200.0]), maxfev=5000)
        if not np.all(np.isfinite(cov)):
            raise RuntimeError("no covariance")
    except (RuntimeError, ValueError, optimize.OptimizeWarning):
        p, cov = None, None
    if p is not None:
        s2 = float(np.sum((g - _saturating(u, *p)) ** 2)) / dof
        t = stats.t.ppf(q, dof)

        def predict(xs):
            us = (np.asarray(xs, dtype=float) - x[0]) / span
            mean = _saturating(us, *p)
            e = np.exp(-p[2] * us)  # the curve's gradient in (c, a, b)
            jac = np.stack([np.ones_like(us), -e, p[1] * us * e], axis=1)
            var = np.einsum("ij,jk,ik->i", jac, cov, jac) + s2
            return mean, t * np.sqrt(var)

        return predict, (float(p[0]), float(p[1]), float(p[2]) / span)
    line = stats.linregress(x, g)
    s2 = float(np.sum((g - (line.intercept + line.slope * x)) ** 2)) / max(len(x) - 2, 1)
    t, xm, sxx = stats.t.ppf(q, max(len(x) - 2, 1)), x.mean(), float(np.sum((x - x.mean()) ** 2)) or 1.0

    def predict_line(xs):
        xs = np.asarray(xs, dtype=float)
        return line.intercept + line.slope * xs, t * np.sqrt(s2 * (1 + 1 / len(x) + (xs - xm) ** 2 / sxx))

    return predict_line, None


def forecast(metric: str, steps, values, *, direction: str | None = "auto", horizon: float = 0.5) -> dict:
    """The verdict, the plateau step (or None) and the trend with its band out to ``horizon`` × the span
    beyond the last step, in the metric's own units. ``direction``: "higher", "lower", None, or "auto"
    (from the name)."""
    if direction == "auto":
        direction = direction_of(metric)
    x = np.asarray(steps, dtype=float)
    y = np.asarray(values, dtype=float)
    keep = np.isfinite(x) & np.isfinite(y)
    x, y = x[keep], y[keep]
    out = {"metric": metric, "direction": direction, "kind": "insufficient", "plateau_step": None,
           "verdict": f"{metric}: too few points to forecast", "steps": [], "mean": [], "lo": [], "hi": [],
           "last_step": int(x[-1]) if x.size else None}
    if x.size < MIN_POINTS:
        return out
    order = np.argsort(x, kind="stable")
    x, y = x[order], y[order]
    moved = 1.0 if direction is None and y[-1] >= y[0] else -1.0 if direction is None else 0.0
    sign = moved or (-1.0 if direction == "lower" else 1.0)
    g = sign * y
    predict, params = _fit(x, g)
    grid = np.linspace(x[0], x[-1] + horizon * (x[-1] - x[0]), 40)
    mean, half = predict(grid)
    out.update(steps=grid.round(1).tolist(), mean=(sign * mean).tolist(),
               lo=(sign * np.where(sign > 0, mean - half, mean + half)).tolist(),
               hi=(sign * np.where(sign > 0, mean + half, mean - half)).tolist(), model="saturating" if params else "linear")
    word = "falling, collapse risk" if direction != "lower" else "rising, divergence risk"
    if direction is not None and (why := _collapse(x, g)):
        out.update(kind="collapse", verdict=f"{metric} {word} ({why})")
        return out
    if params is not None:
        c, a, b = params
        if a * b > 0:
            plateau = x[0] + math.log(1 / TOL) / b
            level = sign * c
            if plateau <= x[-1]:
                seen = int(x[np.searchsorted(x, plateau)])  # the first step observed there: no finer than the data
                out.update(kind="plateau", plateau_step=seen,
                           verdict=f"{metric}: plateau reached around step {seen} (~{level:.4g})")
                return out
            if plateau <= x[-1] + 10 * (x[-1] - x[0]):
                out.update(kind="plateau", plateau_step=int(round(plateau)),
                           verdict=f"{metric}: plateau expected around step {int(round(plateau))} (~{level:.4g})")
                return out
    slope = stats.linregress(x, y).slope * 100
    out.update(kind="improving" if direction is not None else "trend",
               verdict=f"{metric}: {'rising' if slope > 0 else 'falling'} {abs(slope):.3g} per 100 steps, "
                       "no plateau in sight")
    return out


def _collapse(x: np.ndarray, g: np.ndarray) -> str:
    """Why the newest points say collapse, or "" (g: larger is better)."""
    # The newest 1, 2 or 3 points against the trend of those before (4 points at least: the curve has 3
    # parameters), so a fall of the last evaluations does not widen the band it is judged by.
    for m in range(1, min(3, x.size - 4) + 1):
        predict, _ = _fit(x[:-m], g[:-m], q=0.995)  # one-sided 0.5% per check: few false alarms
        mean, half = predict(x[-m:])
        if np.all(g[-m:] < mean - half) and g[-1] < g[:-m].max():
            return f"{'the last point' if m == 1 else f'the last {m} points'} below the trend's prediction band"
    # Robust noise (median step-to-step change): a collapse in the history must not inflate it.
    noise = float(np.median(np.abs(np.diff(g)))) / 0.6745 / math.sqrt(2)
    gain, best = g.max() - g[0], int(np.argmax(g))
    if gain > 4 * noise and g[-1] < g[best] - 0.5 * gain and best < x.size - 1:
        return f"lost {(g[best] - g[-1]) / gain:.0%} of its gain since step {int(x[best])}"
    k = max(4, x.size // 3)
    recent = stats.linregress(x[-k:], g[-k:])
    if recent.slope < 0 and recent.pvalue / 2 < 0.05 and g[-1] < g.max() - 2 * noise:
        return f"down {abs(recent.slope) * 100:.3g} per 100 steps since step {int(x[-k])}"
    return ""
