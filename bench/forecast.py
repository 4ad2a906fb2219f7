"""How early and how often ``rankwatch.forecast`` is right, on generated and recorded eval histories.

Each history is forecast from every prefix (5 evaluations, 6, …), as the report would see it while the run
goes on.

- **Generated**: eval accuracy ``top - rise·exp(-step/tau)`` plus noise, random top, rise, tau, noise
  and eval interval; half of the runs collapse (a linear fall from a random step in the second half).
  The true plateau step is ``tau·ln 20`` (95% of the rise done), the true collapse onset is known.
- **Recorded**: the clean CPU training runs of ``bench/data/corpus_runs`` (real torch, step LR decays):
  eval_accuracy and eval_loss. They never collapse, so every collapse call on them is a false alarm.

Columns: *plateau right* = share of "plateau expected/reached around step N" calls with N within 20% of the
truth; *called early* = how many steps before the true plateau the first right call came (median, and as a
share of the plateau step); *collapse caught* = collapsing runs called before their end, *delay* = steps
from onset to the first call (median); *false collapse* = calls before the onset or on clean runs, per
forecast made and per run.

    python bench/forecast.py [--runs 200] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rankwatch.forecast import MIN_POINTS, forecast  # noqa: E402

RECORDED = Path(__file__).parent / "data" / "corpus_runs"


def generated(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    runs = []
    for i in range(n):
        every = int(rng.choice([10, 20, 25, 50]))
        evals = int(rng.integers(16, 31))
        steps = np.arange(1, evals + 1) * every
        tau = float(rng.uniform(0.08, 0.35)) * steps[-1]
        top, rise, sd = rng.uniform(0.5, 0.95), rng.uniform(0.2, 0.45), rng.uniform(0.003, 0.02)
        y = top - rise * np.exp(-steps / tau) + rng.normal(0.0, sd, steps.size)
        onset = None
        if i % 2:
            onset = int(steps[int(rng.integers(evals // 2, evals - 3))])
            y = y - np.clip(steps - onset, 0, None) * rng.uniform(0.3, 1.5) * rise / steps[-1]
        runs.append({"name": f"gen{i}", "metric": "accuracy", "steps": steps, "values": y,
                     "plateau": tau * math.log(20), "onset": onset})
    return runs


def recorded() -> list[dict]:
    from scenario_runs import read_batches

    runs = []
    for path in sorted(RECORDED.glob("*/rank0.bin")):
        series: dict[str, tuple[list, list]] = {}
        for batch in read_batches(path):
            for name in ("eval_accuracy", "eval_loss"):
                if (s := batch.series.get(name)) is not None:
                    series.setdefault(name, ([], []))[0].extend(s.steps.tolist())
                    series[name][1].extend(s.values.tolist())
        for name, (steps, values) in series.items():
            runs.append({"name": f"{path.parent.name}/{name}", "metric": name, "steps": np.array(steps),
                         "values": np.array(values), "plateau": None, "onset": None})
    return runs


def score(runs: list[dict]) -> dict:
    calls = right = false_calls = made = 0
    early, early_share, delays = [], [], []
    caught = collapsing = false_runs = 0
    for run in runs:
        x, y, truth, onset = run["steps"], run["values"], run["plateau"], run["onset"]
        first_right, first_collapse, run_false = None, None, False
        for k in range(MIN_POINTS, x.size + 1):
            f = forecast(run["metric"], x[:k], y[:k])
            made += 1
            step = int(x[k - 1])
            if f["kind"] == "collapse":
                if onset is None or step < onset:
                    false_calls += 1
                    run_false = True
                elif first_collapse is None:
                    first_collapse = step
            elif f["kind"] == "plateau" and truth is not None and (onset is None or step < onset):
                calls += 1
                ok = abs(f["plateau_step"] - truth) <= 0.2 * truth
                right += ok
                if ok and first_right is None:
                    first_right = step
        if first_right is not None:
            early.append(truth - first_right)
            early_share.append((truth - first_right) / truth)
        if onset is not None:
            collapsing += 1
            if first_collapse is not None:
                caught += 1
                delays.append(first_collapse - onset)
        false_runs += run_false
    clean = sum(r["onset"] is None for r in runs)
    return {"runs": len(runs), "forecasts": made, "plateau_calls": calls, "plateau_right": right / calls if calls else math.nan,
            "early_steps": float(np.median(early)) if early else math.nan,
            "early_share": float(np.median(early_share)) if early_share else math.nan,
            "collapse_caught": f"{caught}/{collapsing}" if collapsing else "-",
            "delay": float(np.median(delays)) if delays else math.nan,
            "false_per_forecast": false_calls / made if made else math.nan,
            "false_runs": f"{false_runs}/{len(runs) if collapsing == 0 else clean + collapsing}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t = time.perf_counter()
    rows = [("generated", score(generated(args.runs, args.seed)))]
    if RECORDED.exists():
        rows.append(("recorded (clean)", score(recorded())))
    cols = ("runs", "forecasts", "plateau_calls", "plateau_right", "early_steps", "early_share", "collapse_caught",
            "delay", "false_per_forecast", "false_runs")
    print(f"{'set':<18}" + "".join(f"{c:>19}" for c in cols))
    for name, r in rows:
        cells = [f"{r[c]:.3f}" if isinstance(r[c], float) and c in ("plateau_right", "early_share", "false_per_forecast")
                 else f"{r[c]:.0f}" if isinstance(r[c], float) else str(r[c]) for c in cols]
        print(f"{name:<18}" + "".join(f"{c:>19}" for c in cells))
    print(f"({time.perf_counter() - t:.1f} s; a run with a plateau call made after its collapse onset is not scored "
          "for the plateau)")


if __name__ == "__main__":
    main()
