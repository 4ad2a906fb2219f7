"""What the default rules' per-rank detectors cost per point, one step per message, on series of the
shapes real training telemetry has (issue 16: at one step per message, a worker's CPU is mostly
this, once per rank per watched metric).

For each metric the default rules watch with more than ``nonfinite`` and each shape (plain noise, a
loss on its way down, an evaluation pause every 50 steps, bursts), the metric's detectors are built
from ``rules.default.toml``, warmed on ``--warm`` points, then fed ``--points`` more one at a time as
stage 1 feeds them; prints CPU µs per point (the best of ``--repeat`` runs) and whether the
detectors follow a line or a period by then. Nothing is asserted.

    python bench/detector_cost.py [--points 3000] [--warm 1000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from rankwatch.stream_processors.rules import default_rules

#: A metric per default rule set that does more than check for non-finite values.
METRICS = ("loss", "grad_norm", "samples_per_s")


def shapes(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng, t = np.random.default_rng(seed), np.arange(n)
    noise = rng.normal(0.0, 0.01, n)
    return {
        "noise": 1.0 + noise,
        "trending": 5.0 * np.exp(-t / (n / 2)) + noise,  # a loss on its way down
        "periodic": 1.0 + np.where(t % 50 == 0, 0.3, 0.0) + noise,  # an evaluation pause every 50 steps
        "bursty": np.where(rng.random(n) < 0.05, 1.5, 1.0) * (1.0 + noise),  # a loader that hiccups
    }


def cost(metric: str, series: np.ndarray, warm: int) -> tuple[float, str]:
    detectors = [rule.build() for rule in default_rules().for_metric(metric).values()]
    points = [series[i : i + 1].copy() for i in range(len(series))]
    for x in points[:warm]:
        for d in detectors:
            d.update(x)
    started = time.process_time()
    for x in points[warm:]:
        for d in detectors:
            d.update(x)
    spent = time.process_time() - started
    followed = {f"period {d.period}" if getattr(d, "period", 0) else "line" if getattr(d, "trending", False) else ""
                for d in detectors} - {""}
    return spent / (len(points) - warm) * 1e6, ", ".join(sorted(followed)) or "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=3000, help="points timed, after the warm ones")
    ap.add_argument("--warm", type=int, default=1000, help="points fed before timing")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    series = shapes(args.warm + args.points)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}; µs CPU per point, one point per update, best of {args.repeat}")
    print("| metric | detectors | " + " | ".join(series) + " |")
    print("|---|---|" + "---|" * len(series))
    for metric in METRICS:
        cells = []
        for x in series.values():
            runs = [cost(metric, x, args.warm) for _ in range(args.repeat)]
            us, followed = min(runs)
            cells.append(f"{us:.0f} ({followed})")
        names = ", ".join(default_rules().for_metric(metric))
        print(f"| {metric} | {names} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
