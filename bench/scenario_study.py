"""Offline study: which cross-rank signal, and which decision on it, catches a straggler soonest.

Not the pipeline (the tables above are): the recorded values go straight into ``CrossRank``
(``min_rel=0.02``), and each rank's per-step score is turned back into its |z|
(``z_scale * Phi^-1((1 + score) / 2)``). Three signals: ``step_time_s`` (up),
``collective_time_s`` (down: in DDP the straggler is the rank that waits least) and the compute
time a rank spent outside collectives and the data loader, ``step_time_s - collective_time_s -
data_wait_s`` (up). This study is why the hook now publishes that as ``compute_time_s`` and the
default rules watch it with ``CrossRank``'s own CUSUM. Three decisions per rank: |z| > 7.7 on 2
steps in a row (the first defaults), |z| > 4.9 on 2 steps, and a one-sided CUSUM on z
(``S = max(0, S + z - k)``, an alarm when ``S > h``, restarted after it). A false alarm is one
outside a fault's window; clean rank-steps are counted as in the tables.
"""

from __future__ import annotations

import numpy as np
from scipy.special import ndtri

from rankwatch.stream_processors.detectors import CrossRank

SIGNALS = {"step_time_s": "up", "collective_time_s": "down", "compute (derived)": "up"}
DECISIONS = {"z > 7.7, 2 steps (first defaults)": ("run", 7.7, 2), "z > 4.9, 2 steps": ("run", 4.9, 2),
             "CUSUM k=2 h=10": ("cusum", 2.0, 10.0)}


def matrix(batches, metric: str, steps: int, ranks: int) -> np.ndarray:
    out = np.full((steps, ranks), np.nan)
    for b in batches:
        s = b.series.get(metric)
        if s is not None:
            keep = s.steps < steps
            out[s.steps[keep], b.rank] = s.values[keep]
    return out


def signal(batches, name: str, steps: int, ranks: int) -> np.ndarray | None:
    step = matrix(batches, "step_time_s", steps, ranks)
    if name == "step_time_s":
        return step
    coll = matrix(batches, "collective_time_s", steps, ranks)
    if name == "collective_time_s":
        return None if np.isnan(coll).all() else coll
    return step - np.nan_to_num(coll) - np.nan_to_num(matrix(batches, "data_wait_s", steps, ranks))


def z_scores(values: np.ndarray, direction: str) -> np.ndarray:
    detector = CrossRank(direction=direction, min_rel=0.02)
    scores = np.array([detector.update(row) for row in values])
    return detector.z_scale * ndtri((1.0 + np.clip(scores, 0.0, 1.0 - 1e-12)) / 2.0)


def alarms(z: np.ndarray, decision: tuple) -> np.ndarray:
    kind, a, b = decision
    fired = np.zeros(z.shape, dtype=bool)
    state = np.zeros(z.shape[1])
    for i, row in enumerate(np.nan_to_num(z)):
        if kind == "run":
            state = np.where(row > a, state + 1, 0)
            fired[i] = state == b
        else:
            state = np.maximum(0.0, state + row - a)
            fired[i] = state > b
            state[fired[i]] = 0.0
    return fired


def study(runs) -> str:
    """``runs``: (spec, batches, window) with window = the fault's [lo, hi) steps or None."""
    lines = ["| signal | decision | stragglers caught (delays, steps) | false alarms | per 10k clean rank-steps |",
             "|---|---|---|---|---|"]
    for name, direction in SIGNALS.items():
        zs = []
        for spec, batches, window in runs:
            values = signal(batches, name, spec.steps, spec.ranks)
            if values is not None:
                zs.append((spec, z_scores(values, direction), window))
        for label, decision in DECISIONS.items():
            delays, false, clean, stragglers = [], 0, 0, 0
            for spec, z, window in zs:
                fired = alarms(z, decision)
                lo, hi = window or (spec.steps, spec.steps)
                outside = np.ones(spec.steps, dtype=bool)
                outside[lo:hi] = False
                false += int(fired[outside].sum())
                clean += spec.ranks * int(outside.sum())
                f = spec.fault
                if f is not None and f.kind == "straggler":
                    stragglers += 1
                    hit = np.flatnonzero(fired[f.onset : f.onset + f.duration, f.rank])
                    if len(hit):
                        delays.append(int(hit[0]))
            lines.append(f"| {name} | {label} | {len(delays)}/{stragglers} ({', '.join(map(str, delays)) or '-'}) "
                         f"| {false} | {1e4 * false / max(clean, 1):.1f} |")
    return "\n".join(lines)
