"""Statistics of one evaluation: summaries with fitting intervals, cross-rank consistency, regression.

Pure numpy/scipy. A metric whose finite values are all 0 or 1 is a proportion (accuracy, pass@1) and
gets binomial methods; anything else is continuous and gets t / rank-based methods. Non-finite
values are left out of every statistic (``n`` counts what was used, ``nonfinite`` what was not).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats

#: Ranks with fewer samples than this take no part in the consistency test (nothing to compare).
MIN_RANK_SAMPLES = 5


def finite(values) -> np.ndarray:
    a = np.asarray(values, dtype=np.float64)
    return a[np.isfinite(a)]


def is_binary(values) -> bool:
    """True when every finite value is 0 or 1 (and there is at least one)."""
    a = finite(values)
    return a.size > 0 and bool(np.all((a == 0.0) | (a == 1.0)))


def wilson_interval(k, n, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Wilson score interval for k successes in n trials (vectorised; equals
    ``scipy.stats.binomtest(k, n).proportion_ci(method="wilson")``).

    >>> lo, hi = wilson_interval(90, 100)
    >>> round(float(lo), 4), round(float(hi), 4)
    (0.8256, 0.9448)
    """
    k, n = np.asarray(k, dtype=np.float64), np.asarray(n, dtype=np.float64)
    z = stats.norm.ppf(0.5 + confidence / 2)
    with np.errstate(invalid="ignore", divide="ignore"):
        p = k / n
        denom = 1 + z * z / n
        center = (p + z * z / (2 * n)) / denom
        half = z / denom * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return np.clip(center - half, 0.0, 1.0), np.clip(center + half, 0.0, 1.0)


@dataclass(frozen=True)
class Summary:
    """n, mean, sample std and a confidence interval; ``method`` names the interval."""

    n: int
    mean: float
    std: float
    ci_low: float
    ci_high: float
    method: str  # "wilson" (0/1 values) or "t"
    nonfinite: int = 0  # NaN and infinite values, left out: a metric with n == 0 and nonfinite > 0 is all NaN

    @property
    def binary(self) -> bool:
        return self.method == "wilson"

    @property
    def half_width(self) -> float:
        return (self.ci_high - self.ci_low) / 2

    @property
    def stderr(self) -> float:
        return self.std / math.sqrt(self.n) if self.n > 1 else math.nan

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> Summary:
        # ``nonfinite`` came later: summaries kept in state from before have none.
        return cls(**{name: d[name] for name in cls.__dataclass_fields__ if name != "nonfinite"},
                   nonfinite=d.get("nonfinite", 0))


def summarize(values, confidence: float = 0.95) -> Summary:
    """Summary of one metric: Wilson interval for 0/1 values, Student t for the rest.

    >>> s = summarize([1, 0, 1, 1])
    >>> s.method, s.n, s.mean
    ('wilson', 4, 0.75)
    >>> summarize([1.0, 2.0, 3.0]).method
    't'
    """
    a = finite(values)
    n = int(a.size)
    bad = int(np.asarray(values).size) - n
    if n == 0:
        return Summary(0, math.nan, math.nan, math.nan, math.nan, "t", bad)
    mean = float(a.mean())
    std = float(a.std(ddof=1)) if n > 1 else math.nan
    if is_binary(a):
        lo, hi = wilson_interval(a.sum(), n, confidence)
        return Summary(n, mean, std, float(lo), float(hi), "wilson", bad)
    if n < 2:
        return Summary(n, mean, std, math.nan, math.nan, "t", bad)
    if std == 0.0:
        return Summary(n, mean, std, mean, mean, "t", bad)
    lo, hi = stats.t.interval(confidence, n - 1, loc=mean, scale=std / math.sqrt(n))
    return Summary(n, mean, std, float(lo), float(hi), "t", bad)


def holm(pvalues) -> np.ndarray:
    """Holm–Bonferroni adjusted p-values (family-wise error control, any dependence).

    >>> holm([0.01, 0.04, 0.03]).tolist()
    [0.03, 0.06, 0.06]
    """
    p = np.asarray(pvalues, dtype=np.float64)
    m = p.size
    order = np.argsort(p)
    adjusted = np.maximum.accumulate(p[order] * (m - np.arange(m)))
    out = np.empty(m)
    out[order] = np.minimum(adjusted, 1.0)
    return out


@dataclass(frozen=True)
class Consistency:
    """Whether the ranks' results of one metric come from one distribution.

    ``test``/``p_value``: the global test over all ranks. ``rank_p``: each rank against the others,
    Holm-adjusted. ``outliers``: ranks named as different (see :func:`consistency`). ``ambiguous``:
    the ranks disagree but too few remain to say which one is off (e.g. two ranks).
    """

    test: str
    statistic: float
    p_value: float
    rank_p: dict[int, float]
    outliers: list[int]
    ambiguous: bool

    @property
    def consistent(self) -> bool:
        return not self.outliers and not self.ambiguous


def _global_test(groups: list[np.ndarray], binary: bool) -> tuple[str, float, float]:
    if binary:
        table = np.array([[g.sum(), g.size - g.sum()] for g in groups])
        if np.any(table.sum(axis=0) == 0):  # every value the same: nothing to test
            return "chi2", 0.0, 1.0
        res = stats.chi2_contingency(table, correction=False)
        return "chi2", float(res.statistic), float(res.pvalue)
    if np.ptp(np.concatenate(groups)) == 0:  # every value the same: nothing to test
        return "kruskal", 0.0, 1.0
    res = stats.kruskal(*groups)
    return "kruskal", float(res.statistic), float(res.pvalue)


def _rank_vs_rest(groups: list[np.ndarray], binary: bool) -> np.ndarray:
    """Two-sided p-value of each group against all the others pooled."""
    p = np.ones(len(groups))
    if binary:
        k = np.array([g.sum() for g in groups])
        n = np.array([g.size for g in groups], dtype=np.float64)
        k_rest, n_rest = k.sum() - k, n.sum() - n
        pooled = k.sum() / n.sum()
        if pooled in (0.0, 1.0):
            return p  # every value is the same
        # Two-proportion z-test (the 2x2 chi-square test without continuity correction), and
        # Fisher's exact test, ~20x slower, where that approximation is poor (an expected count < 5).
        z = (k / n - k_rest / n_rest) / np.sqrt(pooled * (1 - pooled) * (1 / n + 1 / n_rest))
        p = 2 * stats.norm.sf(np.abs(z))
        small = np.minimum(n, n_rest) * min(pooled, 1 - pooled) < 5
        for i in np.flatnonzero(small):
            p[i] = stats.fisher_exact([[k[i], n[i] - k[i]], [k_rest[i], n_rest[i] - k_rest[i]]]).pvalue
        return p
    for i, g in enumerate(groups):
        rest = np.concatenate([h for j, h in enumerate(groups) if j != i])
        if np.ptp(np.concatenate([g, rest])) > 0:
            p[i] = stats.mannwhitneyu(g, rest, alternative="two-sided").pvalue
    return p


def consistency(by_rank: Mapping[int, np.ndarray], *, alpha: float = 0.001) -> Consistency | None:
    """Test whether some rank's results differ from the others' beyond sampling noise.

    Chi-square test of homogeneity for 0/1 metrics, Kruskal–Wallis for continuous ones. To name
    a rank, a step-down procedure: while the global test over the remaining ranks rejects at
    ``alpha`` and at least three ranks remain, the rank most different from the rest (Fisher exact
    / Mann–Whitney, Holm-adjusted) is named if its adjusted p < ``alpha`` and removed. Removing it
    keeps a bad rank from dragging the pooled "rest" away from the good ones, so they are not
    named too. On fair data the chance of naming any rank is at most ``alpha``.
    Returns None when fewer than two ranks have ``MIN_RANK_SAMPLES`` samples.

    >>> rng = np.random.default_rng(0)
    >>> data = {r: rng.binomial(1, 0.9, 300).astype(float) for r in range(4)}
    >>> data[2] = rng.binomial(1, 0.6, 300).astype(float)
    >>> consistency(data).outliers
    [2]
    """
    groups = {r: finite(v) for r, v in by_rank.items()}
    ranks = sorted(r for r, g in groups.items() if g.size >= MIN_RANK_SAMPLES)
    if len(ranks) < 2:
        return None
    binary = all(is_binary(groups[r]) for r in ranks)
    test, statistic, p_value = _global_test([groups[r] for r in ranks], binary)
    first = holm(_rank_vs_rest([groups[r] for r in ranks], binary))
    rank_p = {r: float(p) for r, p in zip(ranks, first)}
    outliers: list[int] = []
    remaining, p_remaining, adjusted = list(ranks), p_value, first
    while p_remaining < alpha and len(remaining) >= 3:
        worst = int(np.argmin(adjusted))
        if adjusted[worst] >= alpha:
            break
        outliers.append(remaining.pop(worst))
        rest = [groups[r] for r in remaining]
        p_remaining = _global_test(rest, binary)[2]
        adjusted = holm(_rank_vs_rest(rest, binary))
    ambiguous = p_remaining < alpha and len(remaining) < 3 and not outliers
    return Consistency(test, statistic, p_value, rank_p, sorted(outliers), ambiguous)


@dataclass(frozen=True)
class Comparison:
    """One-sided test of whether ``new`` is worse than ``old``; ``delta`` = new mean − old mean."""

    test: str
    statistic: float
    p_value: float
    delta: float


def compare(old: Summary, new: Summary, *, higher_is_better: bool = True) -> Comparison:
    """Is ``new`` significantly worse than ``old``? Two-proportion z-test for 0/1 metrics, Welch's t
    from the summaries otherwise. Only a move in the bad direction gives a small p-value.

    >>> old, new = summarize([1] * 90 + [0] * 10), summarize([1] * 70 + [0] * 30)
    >>> compare(old, new).p_value < 0.001
    True
    >>> compare(new, old).p_value > 0.5
    True
    """
    delta = new.mean - old.mean
    if old.n < 2 or new.n < 2:
        return Comparison("none", math.nan, 1.0, delta)
    if old.binary and new.binary:
        pooled = (old.mean * old.n + new.mean * new.n) / (old.n + new.n)
        se = math.sqrt(pooled * (1 - pooled) * (1 / old.n + 1 / new.n))
        if se == 0.0:
            return Comparison("z", 0.0, 1.0, delta)
        z = delta / se
        p = stats.norm.cdf(z) if higher_is_better else stats.norm.sf(z)
        return Comparison("z", z, float(p), delta)
    if not (old.std > 0 or new.std > 0):
        return Comparison("welch", 0.0, 1.0 if delta == 0 or (delta > 0) == higher_is_better else 0.0, delta)
    res = stats.ttest_ind_from_stats(
        new.mean, new.std, new.n, old.mean, old.std, old.n,
        equal_var=False, alternative="less" if higher_is_better else "greater",
    )
    return Comparison("welch", float(res.statistic), float(res.pvalue), delta)


def composite(means: Mapping[str, float], weights: Mapping[str, float]) -> float | None:
    """Weighted sum of metric means; None when a weighted metric is missing or not finite.

    >>> composite({"correct": 0.8, "length": 120.0}, {"correct": 1.0, "length": -0.001})
    0.68
    """
    if not weights:
        return None
    total = 0.0
    for name, weight in weights.items():
        mean = means.get(name)
        if mean is None or not math.isfinite(mean):
            return None
        total += weight * mean
    return round(total, 12)


def parse_weights(text: str) -> dict[str, float]:
    """``"correct=1,reward=0.5"`` → ``{"correct": 1.0, "reward": 0.5}``; ValueError on bad input.

    >>> parse_weights("correct=1, reward=0.5")
    {'correct': 1.0, 'reward': 0.5}
    """
    weights = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            if not sep or not name.strip():
                raise ValueError
            weights[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"composite weights must look like 'metric=weight,…', got {part!r}") from None
    return weights
