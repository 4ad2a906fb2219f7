"""Back-test the detectors on labelled series, scored like the Numenta Anomaly Benchmark (NAB).

The series in ``bench/data/`` come from real small CPU training runs with injected faults (see
``bench/data/generate.py``); ``tune/`` chose the defaults, ``holdout/`` did not. For each detector
and split it prints the NAB score (standard profile, normalised so that detecting nothing is 0
and detecting every window at its first row is 100), recall (windows with a detection), false
positives (flagged rows outside any window, after the probation period) per 10,000 rows, and the
mean delay in rows from a window's start to its first detection. "NAB@tuned" is the holdout score
at the threshold that maximised the tune score, as NAB's optimiser would pick it.

The scorer reproduces NAB 1.x (``nab/sweeper.py``): the first ``min(15%, 750)`` rows are
probation and not scored; a window scores its earliest detection, ``A_TP * sigma(-5 * p) / sigma(5)``
with ``p = -(end - i + 1) / width``, or ``A_FN`` if none; every detection outside a window costs
``A_FP * (2 * sigmoid(-5 * d) - 1)``, ``d`` its distance past the preceding window's end in
window widths (``-A_FP`` if no window precedes). Standard profile: A_TP = 1, A_FP = 0.11, A_FN = 1.

    python bench/nab_score.py                 # every table, about 3 minutes on 2 cores
    python bench/nab_score.py --only cusum    # one detector
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rankwatch.stream_processors.detectors import Detector, build

DATA = Path(__file__).resolve().parent / "data"
STANDARD = {"tp": 1.0, "fp": 0.11, "fn": 1.0}


# --- NAB scoring --------------------------------------------------------------------------------


def scaled_sigmoid(position: float) -> float:
    """NAB's reward curve: 0.987 at a window's left edge, 0 at its right edge, -1 far past it."""
    if position >= 3.0:
        return -1.0
    return 2.0 / (1.0 + math.exp(5.0 * position)) - 1.0


def probation(n: int, percent: float = 0.15) -> int:
    return int(min(math.floor(percent * n), percent * 5000))


def windows_of(labels: np.ndarray) -> list[tuple[int, int]]:
    """Inclusive [start, end] row ranges of the runs of label 1."""
    edges = np.diff(np.r_[0, labels.astype(int), 0])
    return list(zip(np.flatnonzero(edges == 1).tolist(), (np.flatnonzero(edges == -1) - 1).tolist()))


@dataclass(frozen=True)
class Sweep:
    """NAB's per-row bookkeeping for one series: which window a row is in (-1 none, -2 probation)
    and the weighted score the row earns if it is a detection."""

    window: np.ndarray
    weight: np.ndarray
    n_windows: int


def sweep(labels: np.ndarray, costs: dict[str, float] = STANDARD) -> Sweep:
    key = (labels.tobytes(), tuple(sorted(costs.items())))
    if key not in _SWEEPS:
        _SWEEPS[key] = _sweep(labels, costs)
    return _SWEEPS[key]


_SWEEPS: dict[tuple, Sweep] = {}


def _sweep(labels: np.ndarray, costs: dict[str, float]) -> Sweep:
    n = len(labels)
    wins = windows_of(labels)
    window, weight = np.full(n, -1), np.zeros(n)
    max_tp = scaled_sigmoid(-1.0)
    prev_end, prev_width = None, None
    for i in range(n):
        current = next((k for k, (a, b) in enumerate(wins) if a <= i <= b), None)
        if current is not None:
            a, b = wins[current]
            width = b - a + 1
            weight[i] = scaled_sigmoid(-(b - i + 1) / width) * costs["tp"] / max_tp
            window[i] = current
            if i == b:
                prev_end, prev_width = b, width
        else:
            distance = 3.0 if prev_end is None else abs(prev_end - i) / float(prev_width - 1 or 1)
            weight[i] = scaled_sigmoid(distance) * costs["fp"]
    window[: probation(n)] = -2
    scored_windows = len({int(w) for w in window if w >= 0})
    return Sweep(window, weight, scored_windows)


@dataclass
class Tally:
    raw: float = 0.0
    windows: int = 0
    detected: int = 0
    fp_rows: int = 0
    rows: int = 0
    delays: tuple[int, ...] = ()

    def add(self, sw: Sweep, detections: np.ndarray, costs: dict[str, float] = STANDARD) -> None:
        scored = sw.window != -2
        self.rows += int(scored.sum())
        fp = detections & (sw.window == -1)
        self.fp_rows += int(fp.sum())
        self.raw += float(sw.weight[fp].sum())
        for k in sorted({int(w) for w in sw.window if w >= 0}):
            self.windows += 1
            hits = np.flatnonzero(detections & (sw.window == k))
            if len(hits):
                self.detected += 1
                self.raw += max(-costs["fn"], float(sw.weight[hits[0]]))
                self.delays += (int(hits[0] - np.flatnonzero(sw.window == k)[0]),)
            else:
                self.raw -= costs["fn"]

    def nab(self, costs: dict[str, float] = STANDARD) -> float:
        null, perfect = -costs["fn"] * self.windows, costs["tp"] * self.windows
        return 100.0 * (self.raw - null) / (perfect - null) if self.windows else float("nan")

    def row(self) -> str:
        recall = self.detected / self.windows if self.windows else float("nan")
        delay = np.mean(self.delays) if self.delays else float("nan")
        return f"{self.nab():7.1f} {recall:6.2f} {1e4 * self.fp_rows / max(self.rows, 1):8.1f} {delay:7.1f}"


# --- data and detectors -------------------------------------------------------------------------


@dataclass(frozen=True)
class Series:
    split: str
    name: str  # e.g. lr100_s0_loss
    values: np.ndarray
    labels: np.ndarray

    @property
    def fault(self) -> str:
        return re.split(r"_s\d+_", self.name)[0]

    @property
    def metric(self) -> str:
        return re.split(r"_s\d+_", self.name)[1]


def load(split: str) -> list[Series]:
    out = []
    for path in sorted((DATA / split).glob("*.csv")):
        if path.name.startswith("straggler8"):
            continue
        with path.open() as f:
            rows = list(csv.DictReader(f))
        values = np.array([float(r["value"]) for r in rows])
        out.append(Series(split, path.stem, values, np.array([int(r["label"]) for r in rows])))
    return out


#: Detectors under test, with default parameters (``plateau`` and ``stall`` need other inputs:
#: a long improving metric, timestamps; ``crossrank`` has its own table).
DETECTORS: dict[str, Callable[[], Detector]] = {
    name: (lambda name=name: build(name))
    for name in ("ensemble", "nonfinite", "spike", "ewma", "cusum", "page_hinkley", "trend", "collapse", "blowup")
}

#: What a sensible rule file puts on each metric of a training run (the lead's default rules may differ).
RULES: dict[str, list[tuple[str, dict]]] = {
    "loss": [("nonfinite", {}), ("spike", {}), ("cusum", {"direction": "up"}), ("trend", {"direction": "up"})],
    "grad_norm": [("nonfinite", {}), ("spike", {}), ("blowup", {})],
    "step_time": [("cusum", {"direction": "up"})],  # one slow step is no fault; a slower rank is
    "reward": [("nonfinite", {}), ("collapse", {})],
    "entropy": [("nonfinite", {}), ("collapse", {})],
    "kl": [("nonfinite", {}), ("blowup", {})],
}


def _scores(factory: Callable[[], Detector], series: Series) -> tuple[np.ndarray, float]:
    d = factory()
    return d.update(series.values), d.threshold


def evaluate(name: str, factory: Callable[[], Detector], splits: dict[str, list[Series]]) -> None:
    scored = {split: [(s, *_scores(factory, s)) for s in items] for split, items in splits.items()}
    cells = []
    for split in splits:
        tally = Tally()
        for s, scores, threshold in scored[split]:
            tally.add(sweep(s.labels), scores >= threshold)
        cells.append(tally.row())
    # NAB's optimiser: the threshold that maximises the tune score, applied to the holdout.
    best = max(_candidates(scored["tune"]), key=lambda t: _raw(scored["tune"], t))
    tally = Tally()
    for s, scores, _ in scored["holdout"]:
        tally.add(sweep(s.labels), scores >= best)
    print(f"{name:14s} " + " | ".join(cells) + f" | {tally.nab():7.1f} (t={best:.3g})", flush=True)


def _candidates(scored) -> np.ndarray:
    """Thresholds worth trying: the distinct scores of the top half, thinned to at most 300."""
    values = np.unique(np.concatenate([sc for _, sc, _ in scored]))
    values = values[values >= np.median(values)]
    return values[np.linspace(0, len(values) - 1, min(300, len(values))).astype(int)]


def _raw(scored, threshold: float) -> float:
    tally = Tally()
    for s, scores, _ in scored:
        tally.add(sweep(s.labels), scores >= threshold)
    return tally.nab()


def rules_table(splits: dict[str, list[Series]]) -> None:
    """Each faulty series with its metric's rule set (a detection = any detector decides)."""
    print("\nPer scenario, with the metric's rule set (any detector):")
    print(f"{'series':32s} {'rules':34s} {'detected':>8s} {'delay':>6s} {'FP/10k':>7s}")
    clean_fp, clean_rows = 0, 0
    found = {split: [0, 0] for split in splits}
    for split, items in splits.items():
        for s in items:
            rules = RULES.get(s.metric, [])
            if not rules:
                continue
            hit = np.zeros(len(s.values), dtype=bool)
            for name, params in rules:
                d = build(name, **params)
                hit |= d.decide(d.update(s.values))
            sw = sweep(s.labels)
            tally = Tally()
            tally.add(sw, hit)
            if not tally.windows:
                clean_fp += tally.fp_rows
                clean_rows += tally.rows
            else:
                found[split][0] += bool(tally.detected)
                found[split][1] += 1
            delay = str(tally.delays[0]) if tally.delays else "-"
            label = "+".join(n for n, _ in rules)
            print(f"{split + '/' + s.name:32s} {label:34s} {str(bool(tally.detected)) if tally.windows else 'clean':>8s} "
                  f"{delay:>6s} {1e4 * tally.fp_rows / max(tally.rows, 1):7.1f}")
    print("faulty series detected: " + ", ".join(f"{k} {a}/{b}" for k, (a, b) in found.items()))
    print(f"clean series: {clean_fp} flagged rows in {clean_rows} ({1e4 * clean_fp / max(clean_rows, 1):.1f} per 10k)")


def plateau_table(splits: dict[str, list[Series]]) -> None:
    """``plateau`` is an info signal with a persistent condition, so it gets its own lines."""
    print("\nPlateau (info; default window 200, tolerance 1% of the level) on every loss series:")
    for split, items in splits.items():
        cells = []
        for s in items:
            if s.metric != "loss":
                continue
            d = build("plateau")
            flags = d.decide(d.update(s.values))
            if s.fault == "plateau":
                tally = Tally()
                tally.add(sweep(s.labels), flags)
                cells.append(f"{s.name}: delay {tally.delays[0] if tally.delays else 'missed'}")
            else:
                cells.append(f"{s.name}: {int(flags.sum())} rows flagged")
        print(f"  {split}: " + "; ".join(cells))


def crossrank_table() -> None:
    """The cross-rank detector on real per-rank step times of 8 ranks, one of which straggles."""
    print("\nCross-rank stragglers (8 ranks, real step times, one rank +0.6 ms/step for 200 steps):")
    print(f"{'file':24s} {'rank':>4s} {'named':>6s} {'delay':>6s} {'other flags/10k rank-steps':>27s}")
    for path in sorted(DATA.glob("*/straggler8_s*.csv")):
        with path.open() as f:
            rows = list(csv.DictReader(f))
        times = np.array([[float(r[f"rank{k}"]) for k in range(8)] for r in rows])
        straggler = np.array([int(r["straggler"]) for r in rows])
        rank = int(straggler.max())
        d = build("crossrank", direction="up", min_rel=0.02)
        flags = d.decide(d.update(times))
        period = np.flatnonzero(straggler >= 0)
        hits = np.flatnonzero(flags[period, rank])
        others = flags.copy()
        others[period, rank] = False
        delay = str(int(hits[0])) if len(hits) else "-"
        print(f"{path.parent.name + '/' + path.name:24s} {rank:4d} {str(bool(len(hits))):>6s} {delay:>6s} "
              f"{1e4 * others.sum() / others.size:27.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=sorted(DETECTORS), help="score one detector, skip the other tables")
    args = parser.parse_args(argv)
    splits = {split: load(split) for split in ("tune", "holdout")}
    if not all(splits.values()):
        print("no data: run python bench/data/generate.py", file=sys.stderr)
        return 1
    n = {k: (len(v), sum(len(s.values) for s in v), sum(len(windows_of(s.labels)) for s in v)) for k, v in splits.items()}
    print("NAB standard profile, default parameters and thresholds; every series of each split "
          f"(tune: {n['tune'][0]} series, {n['tune'][1]} rows, {n['tune'][2]} windows; "
          f"holdout: {n['holdout'][0]}, {n['holdout'][1]}, {n['holdout'][2]}).")
    head = f"{'NAB':>7s} {'recall':>6s} {'FP/10k':>8s} {'delay':>7s}"
    print(f"{'detector':14s} {'tune':^31s} | {'holdout':^31s} | NAB@tuned")
    print(f"{'':14s} {head} | {head} |")
    for name, factory in DETECTORS.items():
        if args.only in (None, name):
            evaluate(name, factory, splits)
    if args.only is None:
        rules_table(splits)
        plateau_table(splits)
        crossrank_table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
